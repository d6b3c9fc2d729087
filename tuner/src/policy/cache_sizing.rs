//! Cache and read-ahead sizing, shared by the shipped policies.

use crate::observation::{Action, Decision, Observation};

/// Deepens the stages' read-aheads: one whose readers waited for a fetch in the window (they
/// caught up with it: it is not far enough ahead) doubles its depth, up to its ceiling. A
/// read-ahead costs disk (the objects fetched ahead wait there until read), not memory or
/// CPU, so it is never made shallower; the ceiling bounds the disk.
pub fn read_ahead_decisions(obs: &Observation) -> Vec<Decision> {
    let mut out = Vec::new();
    for (i, s) in obs.stages.iter().enumerate() {
        let Some(r) = s.read_ahead.filter(|r| !r.pinned) else {
            continue;
        };
        if r.waits == 0 || r.depth >= r.max_depth {
            continue;
        }
        let depth = (r.depth * 2).clamp(r.depth + 1, r.max_depth);
        out.push(Decision {
            action: Action::SetReadAhead { stage: i, depth },
            reason: format!(
                "{} of {} reads waited for their fetch: read further ahead",
                r.waits, r.reads
            ),
        });
    }
    out
}

/// Resizes the stages' caches and read-aheads ([`read_ahead_decisions`]): a cache that evicted in the window (what passes through it does
/// not fit) doubles, up to its ceiling and what the memory budget leaves after every buffer and
/// the other caches; a cache larger than that room shrinks to it. [`enforce`](crate::enforce)
/// clamps the result again.
pub fn cache_decisions(obs: &Observation) -> Vec<Decision> {
    let mut out = read_ahead_decisions(obs);
    out.extend(byte_cache_decisions(obs));
    out
}

fn byte_cache_decisions(obs: &Observation) -> Vec<Decision> {
    let budget = obs.budgets.map_or(u64::MAX, |b| b.memory_bytes);
    let committed = crate::guard::committed_bytes(obs);
    let mut out = Vec::new();
    for (i, s) in obs.stages.iter().enumerate() {
        let Some(c) = s.cache.filter(|c| !c.pinned) else {
            continue;
        };
        let room = budget.saturating_sub(committed - c.capacity_bytes);
        let (bytes, reason) = if c.capacity_bytes > room {
            (
                room,
                "memory budget: the buffers need the cache's bytes".to_owned(),
            )
        } else if c.evicted_bytes > 0 && c.capacity_bytes < c.max_bytes.min(room) {
            (
                c.capacity_bytes
                    .saturating_mul(2)
                    .max(1 << 20)
                    .min(c.max_bytes)
                    .min(room),
                format!(
                    "evicted {} KiB in the window: what passes does not fit",
                    c.evicted_bytes >> 10
                ),
            )
        } else {
            continue;
        };
        if bytes != c.capacity_bytes {
            out.push(Decision {
                action: Action::SetCacheBytes { stage: i, bytes },
                reason,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{enforce, Budgets, CacheStats, ReadAheadStats, StageObservation};

    fn obs(cache: CacheStats, memory: u64) -> Observation {
        Observation {
            stages: vec![
                StageObservation {
                    name: "fetch".into(),
                    budget_items: 10,
                    budget_bytes: u64::MAX,
                    item_bytes: 1000,
                    cache: Some(cache),
                    ..Default::default()
                },
                StageObservation {
                    name: "decode".into(),
                    budget_items: 10,
                    budget_bytes: u64::MAX,
                    item_bytes: 1000,
                    ..Default::default()
                },
            ],
            budgets: Some(Budgets {
                memory_bytes: memory,
                cores: 2,
            }),
            ..Default::default()
        }
    }

    fn cache(capacity: u64, max: u64, evicted: u64) -> CacheStats {
        CacheStats {
            capacity_bytes: capacity,
            max_bytes: max,
            evicted_bytes: evicted,
            ..Default::default()
        }
    }

    fn planned(o: &Observation) -> Option<u64> {
        match enforce(cache_decisions(o), o).as_slice() {
            [] => None,
            [Decision {
                action: Action::SetCacheBytes { stage: 0, bytes },
                ..
            }] => Some(*bytes),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_evicting_cache_doubles_up_to_its_ceiling_and_the_memory_budget() {
        assert_eq!(
            planned(&obs(cache(4 << 20, 64 << 20, 1), 1 << 30)),
            Some(8 << 20)
        );
        assert_eq!(
            planned(&obs(cache(40 << 20, 64 << 20, 1), 1 << 30)),
            Some(64 << 20)
        );
        // 20,000 bytes of buffers leave 10 MB - 20,000 for the cache.
        let room = (10 << 20) - 20_000;
        assert_eq!(
            planned(&obs(cache(8 << 20, 64 << 20, 1), 10 << 20)),
            Some(room)
        );
        assert_eq!(
            planned(&obs(cache(64 << 20, 64 << 20, 1), 1 << 30)),
            None,
            "at its ceiling"
        );
        assert_eq!(
            planned(&obs(cache(4 << 20, 64 << 20, 0), 1 << 30)),
            None,
            "no evictions"
        );
    }

    #[test]
    fn a_read_ahead_its_readers_caught_up_with_doubles_up_to_its_ceiling() {
        let with = |r: ReadAheadStats| Observation {
            stages: vec![StageObservation {
                name: "decode".into(),
                read_ahead: Some(r),
                ..Default::default()
            }],
            ..Default::default()
        };
        let ra = |depth, waits, pinned| ReadAheadStats {
            depth,
            max_depth: 8,
            pinned,
            reads: 100,
            waits,
        };
        let depth = |o: &Observation| match enforce(cache_decisions(o), o).as_slice() {
            [] => None,
            [Decision {
                action: Action::SetReadAhead { stage: 0, depth },
                ..
            }] => Some(*depth),
            other => panic!("{other:?}"),
        };
        assert_eq!(depth(&with(ra(1, 3, false))), Some(2));
        assert_eq!(depth(&with(ra(3, 1, false))), Some(6));
        assert_eq!(depth(&with(ra(6, 1, false))), Some(8), "up to the ceiling");
        assert_eq!(depth(&with(ra(8, 5, false))), None, "at the ceiling");
        assert_eq!(depth(&with(ra(2, 0, false))), None, "no reader waited");
        assert_eq!(depth(&with(ra(2, 4, true))), None, "pinned");
    }

    #[test]
    fn a_cache_the_memory_budget_cannot_hold_shrinks_and_a_pinned_one_stays() {
        let room = (2 << 20) - 20_000;
        assert_eq!(
            planned(&obs(cache(8 << 20, 64 << 20, 0), 2 << 20)),
            Some(room)
        );
        let mut pinned = cache(8 << 20, 8 << 20, 1);
        pinned.pinned = true;
        assert_eq!(planned(&obs(pinned, 2 << 20)), None);
    }
}
