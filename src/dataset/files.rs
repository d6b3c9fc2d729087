//! Which files an epoch reads: discovery, shuffling, sharding.

use std::path::{Path, PathBuf};

use flowgate_actors::error::PipelineError;

use crate::sampler::{Sampler, ShareLengths};

/// A dataset's file list, and how each epoch orders and shards it.
///
/// # Examples
///
/// ```no_run
/// use flowgate::dataset::Files;
///
/// let files = Files::dir("/data/train", &["jpg", "jpeg"])?  // or Files::list(..), Files::new(..)
///     .shuffle(42)                                          // a new order every epoch
///     .shard_from_env()?;                                   // RANK / WORLD_SIZE, if set
/// let epoch0: Vec<_> = files.epoch(0);
/// # Ok::<(), flowgate::PipelineError>(())
/// ```
#[derive(Clone, Debug)]
pub struct Files {
    paths: Vec<PathBuf>,
    sampler: Sampler,
}

impl Files {
    /// Exactly these paths, in this order.
    pub fn new(paths: impl IntoIterator<Item = impl Into<PathBuf>>) -> Self {
        let paths: Vec<PathBuf> = paths.into_iter().map(Into::into).collect();
        Self {
            sampler: Sampler::new(paths.len()),
            paths,
        }
    }

    /// Every file under `root` (recursively, following symbolic links) whose extension is one
    /// of `extensions` (case-insensitive; empty: every file), in sorted order.
    ///
    /// Each directory is entered once and each file listed once, by device and inode: a
    /// symbolic link back up the tree (a loop) or a second link to a folder or file already
    /// seen is skipped, and reported once in a warning with how many were skipped, so a tree
    /// with loops still lists each real file once, in bounded time.
    pub fn dir(root: impl AsRef<Path>, extensions: &[&str]) -> Result<Self, PipelineError> {
        let root = root.as_ref();
        let listing = |dir: &Path, e| PipelineError::io(format!("listing {}", dir.display()), e);
        let mut seen = Seen::default();
        let mut paths = Vec::new();
        let meta = std::fs::metadata(root).map_err(|e| listing(root, e))?;
        seen.first(&meta);
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let mut entries = std::fs::read_dir(&dir)
                .map_err(|e| listing(&dir, e))?
                .map(|e| e.map(|e| e.path()))
                .collect::<Result<Vec<PathBuf>, _>>()
                .map_err(|e| listing(&dir, e))?;
            entries.sort();
            let mut subdirs = Vec::new();
            for path in entries {
                // Links are followed.
                let wanted = extensions.is_empty()
                    || path
                        .extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| extensions.iter().any(|x| x.eq_ignore_ascii_case(e)));
                match std::fs::metadata(&path) {
                    Ok(meta) if meta.is_dir() => {
                        if seen.first(&meta) {
                            subdirs.push(path);
                        } else {
                            seen.dirs_skipped(&path);
                        }
                    }
                    Ok(meta) if wanted => {
                        if seen.first(&meta) {
                            paths.push(path);
                        } else {
                            seen.files_skipped(&path);
                        }
                    }
                    Ok(_) => {}
                    // A dangling link: a file the decoder will report missing.
                    Err(_) if wanted => paths.push(path),
                    Err(_) => {}
                }
            }
            // Depth first, in sorted order: the first path to reach a folder is the same on
            // every run.
            stack.extend(subdirs.into_iter().rev());
        }
        seen.report(root);
        paths.sort();
        Ok(Self::new(paths))
    }

    /// The paths in a list file, one per line (blank lines and `#` comments skipped; relative
    /// paths are relative to the list's directory). A line is taken as the file name's bytes
    /// (on Unix a name need not be UTF-8); only a trailing `\r` and surrounding spaces and
    /// tabs are trimmed.
    pub fn list(file: impl AsRef<Path>) -> Result<Self, PipelineError> {
        let file = file.as_ref();
        let bytes = std::fs::read(file)
            .map_err(|e| PipelineError::io(format!("reading the list {}", file.display()), e))?;
        let base = file.parent().unwrap_or(Path::new("."));
        let mut paths = Vec::new();
        for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
            let line = line.trim_ascii();
            if line.is_empty() || line.starts_with(b"#") {
                continue;
            }
            paths.push(base.join(path_from_bytes(line).map_err(|e| {
                PipelineError::config(format!("{}:{}: {e}", file.display(), i + 1))
            })?));
        }
        Ok(Self::new(paths))
    }

    /// Shuffles every epoch with a seed derived from `seed` and the epoch number: the same seed
    /// gives the same orders, every epoch a different one.
    pub fn shuffle(self, seed: u64) -> Self {
        self.map_sampler(|s| s.shuffle(seed))
    }

    /// Keeps shard `rank` of `world`: every `world`-th file of each epoch's order starting at
    /// `rank`, so shards are disjoint and together cover the epoch. A rank outside `0..world`
    /// is an error (see [`Sampler::shard`]).
    pub fn shard(self, rank: usize, world: usize) -> Result<Self, PipelineError> {
        self.try_map_sampler(|s| s.shard(rank, world))
    }

    /// Shards by the `RANK` and `WORLD_SIZE` environment variables, or not at all when neither
    /// is set; a misconfigured launch is an error (see [`Sampler::shard_from_env`]).
    pub fn shard_from_env(self) -> Result<Self, PipelineError> {
        self.try_map_sampler(Sampler::shard_from_env)
    }

    /// Keeps worker `worker`'s part of this rank's share split among `workers` processes
    /// (PyTorch `DataLoader` workers); see [`Sampler::split`].
    pub fn split(self, worker: usize, workers: usize) -> Result<Self, PipelineError> {
        self.try_map_sampler(|s| s.split(worker, workers))
    }

    /// Makes every shard the same length by dropping or repeating; see [`ShareLengths`].
    pub fn shard_lengths(self, lengths: ShareLengths) -> Self {
        self.map_sampler(|s| s.shard_lengths(lengths))
    }

    /// Draws `samples` files per epoch in proportion to `weights` (one per file); see
    /// [`Sampler::weighted`].
    pub fn weighted(
        mut self,
        weights: &[f64],
        samples: usize,
        replacement: bool,
    ) -> Result<Self, PipelineError> {
        self.sampler = self.sampler.weighted(weights, samples, replacement)?;
        Ok(self)
    }

    fn map_sampler(mut self, f: impl FnOnce(Sampler) -> Sampler) -> Self {
        self.sampler = f(self.sampler);
        self
    }

    fn try_map_sampler(
        mut self,
        f: impl FnOnce(Sampler) -> Result<Sampler, PipelineError>,
    ) -> Result<Self, PipelineError> {
        self.sampler = f(self.sampler)?;
        Ok(self)
    }

    /// What a checkpoint of an epoch over these files depends on, as named fields for
    /// [`PipelineBuilder::checkpoint_fields`](crate::PipelineBuilder::checkpoint_fields): the
    /// dataset (a hash of every path, in order, and their number) and the sampler (seed,
    /// rank and world size, shard lengths, weights).
    pub fn fingerprint(&self) -> Vec<(&'static str, String)> {
        use crate::hash::{fnv1a, FNV_OFFSET};
        let hash = self.paths.iter().fold(FNV_OFFSET, |h, p| {
            fnv1a(fnv1a(h, p.as_os_str().as_encoded_bytes()), b"\0")
        });
        let mut f = vec![(
            "dataset",
            format!("{} files, {hash:016x}", self.paths.len()),
        )];
        f.extend(self.sampler.fingerprint());
        f
    }

    /// Number of files in the whole dataset.
    pub fn len(&self) -> usize {
        self.paths.len()
    }

    /// Whether there are no files.
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// How each epoch orders and shards the files (for
    /// [`PipelineBuilder::source_sampled`](crate::PipelineBuilder::source_sampled), whose
    /// checkpoints merge across ranks).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The paths, in dataset order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// This shard's files for `epoch`, in order.
    pub fn epoch(&self, epoch: u64) -> Vec<PathBuf> {
        self.epoch_indices(epoch)
            .into_iter()
            .map(|i| self.paths[i].clone())
            .collect()
    }

    /// This shard's files for `epoch` as indices into [`paths`](Self::paths), in order: for
    /// items that carry per-file data (labels) along with the file.
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        self.sampler.epoch(epoch)
    }

    /// ImageFolder-style classes: every file's label is the index of its parent folder among
    /// the dataset's sorted parent folders. Computed over the whole dataset, not this shard,
    /// so every rank and every epoch agree.
    pub fn folder_labels(&self) -> FolderLabels {
        let mut dirs: Vec<PathBuf> = self
            .paths
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect();
        dirs.sort();
        dirs.dedup();
        FolderLabels { dirs }
    }
}

/// A path from a list line's bytes: any bytes on Unix; UTF-8 elsewhere.
fn path_from_bytes(b: &[u8]) -> Result<PathBuf, String> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        Ok(PathBuf::from(std::ffi::OsStr::from_bytes(b)))
    }
    #[cfg(not(unix))]
    {
        std::str::from_utf8(b)
            .map(PathBuf::from)
            .map_err(|_| "a file name that is not UTF-8 (only Unix takes any bytes)".to_owned())
    }
}

/// What a directory walk has entered or listed, by device and inode (on Unix; elsewhere
/// every path is new), and what it skipped.
#[derive(Default)]
struct Seen {
    ids: std::collections::HashSet<(u64, u64)>,
    dirs: usize,
    files: usize,
    example: Option<PathBuf>,
}

impl Seen {
    /// Whether `meta`'s file is new (and notes it).
    fn first(&mut self, meta: &std::fs::Metadata) -> bool {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            self.ids.insert((meta.dev(), meta.ino()))
        }
        #[cfg(not(unix))]
        {
            let _ = meta;
            true
        }
    }

    fn dirs_skipped(&mut self, path: &Path) {
        self.dirs += 1;
        self.example.get_or_insert_with(|| path.to_path_buf());
    }

    fn files_skipped(&mut self, path: &Path) {
        self.files += 1;
        self.example.get_or_insert_with(|| path.to_path_buf());
    }

    fn report(&self, root: &Path) {
        if let Some(example) = &self.example {
            tracing::warn!(
                "{}: skipped {} folder(s) and {} file(s) reached a second time through symbolic \
                 links (loops or aliases), e.g. {}",
                root.display(),
                self.dirs,
                self.files,
                example.display()
            );
        }
    }
}

/// Labels from folder names (see [`Files::folder_labels`]): `root/cat/1.jpg` → the index of
/// `root/cat` among the sorted folders holding files, as torchvision's `ImageFolder` numbers
/// the classes of a `root/<class>/<file>` tree.
#[derive(Clone, Debug)]
pub struct FolderLabels {
    dirs: Vec<PathBuf>,
}

impl FolderLabels {
    /// The label of `path`, or `None` if its folder holds none of the dataset's files.
    pub fn label(&self, path: &Path) -> Option<i64> {
        let dir = path.parent()?;
        let i = self.dirs.binary_search_by(|d| d.as_path().cmp(dir)).ok()?;
        i64::try_from(i).ok()
    }

    /// The class names (the folders' names), in label order.
    pub fn classes(&self) -> Vec<String> {
        self.dirs
            .iter()
            .map(|d| {
                d.file_name().map_or_else(
                    || d.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                )
            })
            .collect()
    }

    /// Number of classes.
    pub fn len(&self) -> usize {
        self.dirs.len()
    }

    /// Whether there are no classes (no files).
    pub fn is_empty(&self) -> bool {
        self.dirs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffles_per_epoch_and_shards_disjointly() {
        let all: Vec<PathBuf> = (0..103)
            .map(|i| PathBuf::from(format!("{i}.jpg")))
            .collect();
        let f = Files::new(all.clone()).shuffle(7);
        assert_eq!(f.epoch(0), f.epoch(0), "deterministic");
        assert_ne!(f.epoch(0), f.epoch(1), "reshuffled per epoch");
        let mut sorted = f.epoch(1);
        sorted.sort();
        let mut expected = all.clone();
        expected.sort();
        assert_eq!(sorted, expected, "a permutation");
        let mut union: Vec<PathBuf> = (0..4)
            .flat_map(|r| f.clone().shard(r, 4).unwrap().epoch(3))
            .collect();
        assert_eq!(union.len(), 103, "disjoint");
        union.sort();
        assert_eq!(union, expected, "complete");
        assert_eq!(
            Files::new(all.clone()).epoch(5),
            all,
            "no shuffle: list order"
        );
    }

    #[test]
    fn folder_labels_number_the_sorted_folders_of_the_whole_dataset() {
        let paths = ["d/zebra/1.jpg", "d/cat/2.jpg", "d/dog/3.jpg", "d/cat/4.jpg"];
        let files = Files::new(paths).shuffle(3).shard(1, 2).unwrap();
        let labels = files.folder_labels();
        assert_eq!(labels.classes(), ["cat", "dog", "zebra"]);
        assert_eq!(labels.len(), 3);
        let of = |p: &str| labels.label(Path::new(p));
        assert_eq!(
            [of("d/cat/4.jpg"), of("d/dog/3.jpg"), of("d/zebra/1.jpg")],
            [Some(0), Some(1), Some(2)]
        );
        assert_eq!(of("d/cow/5.jpg"), None, "a folder the dataset lacks");
        // Every rank numbers the same way, whatever its shard holds.
        let other = Files::new(paths)
            .shuffle(3)
            .shard(0, 2)
            .unwrap()
            .folder_labels();
        assert_eq!(other.classes(), labels.classes());
        // Indices name the same files as paths.
        for e in 0..3 {
            let by_index: Vec<PathBuf> = files
                .epoch_indices(e)
                .into_iter()
                .map(|i| files.paths()[i].clone())
                .collect();
            assert_eq!(by_index, files.epoch(e));
        }
    }

    /// A fresh folder in the system's temporary directory.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("flowgate-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[cfg(unix)]
    #[test]
    fn symlink_loops_and_aliases_list_each_real_file_once() {
        use std::os::unix::fs::symlink;
        let root = scratch("loops");
        for d in ["a", "b/c"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in ["a/1.jpg", "a/2.JPG", "b/3.jpg", "b/c/4.jpg", "b/notes.txt"] {
            std::fs::write(root.join(f), f).unwrap();
        }
        // Two loops (to the root and to a parent), a second link to a folder, one to a file,
        // and a dangling link (kept: the decoder reports it missing).
        symlink(&root, root.join("a/up")).unwrap();
        symlink("..", root.join("b/c/back")).unwrap();
        symlink(root.join("a"), root.join("b/alias")).unwrap();
        symlink(root.join("a/1.jpg"), root.join("b/same.jpg")).unwrap();
        symlink(root.join("gone.jpg"), root.join("b/dangling.jpg")).unwrap();
        let files = Files::dir(&root, &["jpg"]).unwrap();
        let rel: Vec<String> = files
            .paths()
            .iter()
            .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        assert_eq!(
            rel,
            [
                "a/1.jpg",
                "a/2.JPG",
                "b/3.jpg",
                "b/c/4.jpg",
                "b/dangling.jpg"
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_list_takes_any_file_name_bytes() {
        use std::os::unix::ffi::OsStrExt;
        let root = scratch("list");
        let name = std::ffi::OsStr::from_bytes(b"caf\xe9.jpg");
        let mut list = b"# comment\n\n  one.jpg \r\n".to_vec();
        list.extend_from_slice(name.as_bytes());
        list.extend_from_slice(b"\n/abs/two.jpg\n");
        std::fs::write(root.join("list.txt"), &list).unwrap();
        let files = Files::list(root.join("list.txt")).unwrap();
        assert_eq!(
            files.paths(),
            [
                root.join("one.jpg"),
                root.join(name),
                PathBuf::from("/abs/two.jpg")
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
