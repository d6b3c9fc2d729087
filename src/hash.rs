//! FNV-1a: the one small hash of names that seeds (a file's augmentation) and fingerprints (a
//! dataset's checkpoints) are made from. Kept apart from the decoders and the datasets, which
//! both use it.

/// FNV-1a's starting state.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over `bytes`, continuing from `h`.
pub(crate) fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
