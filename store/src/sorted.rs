//! A frozen memtable's live records in key order: what a flush writes,
//! sorted on the shard's own thread in steps of bounded work.
//!
//! The memtable is a hash table over an append-only log, so its order is
//! made at flush time. Comparing keys where they lie costs a random load
//! per comparison (~550 ns in a large working set), so each key's bytes
//! are loaded once per round, a window of them at a time, with loads
//! overlapped across the entries, and the entries are ordered by a
//! least-significant-digit radix sort over that window: no comparisons,
//! a fixed amount of work per entry and pass, and passes over bytes that
//! every entry shares are skipped. Entries still equal over a whole window
//! (keys sharing its bytes) are ordered again by the next window.
//!
//! A window is [`WINDOW`] key bytes (zero-padded) and one byte saying how
//! many of the key's bytes remain, capped at `WINDOW + 1`. That order is
//! the keys' byte order: if two keys agree on the padded window, the one
//! with fewer bytes left either ends inside it and is a prefix of the
//! other (smaller), or both go on past it (equal, next window).
//!
//! Work is done in steps ([`Sort::step`]) so that a shard can interleave
//! it with requests, as it does the flush's writes. There is no helper
//! thread: on a host whose cores the shards fill, a helper would take
//! whole scheduler ticks (4 ms) from some shard; steps take what the
//! shard gives them.

use crate::memtable::Memtable;

/// Key bytes one round compares.
pub const WINDOW: usize = 23;

/// Radix digits (bytes) of a window.
const DIGITS: usize = WINDOW + 1;

/// Loads started ahead of use while loading windows.
const AHEAD: usize = 16;

/// Ranges this small are ordered by comparing whole keys.
const SMALL: usize = 16;

/// Index slots a unit of work scans while collecting.
const SLOTS_PER_UNIT: usize = 4;

/// A key's window (big-endian words) and its record.
#[derive(Clone, Copy, Default)]
struct Entry {
    w: [u64; 3],
    addr: u64,
}

impl Entry {
    #[inline]
    fn digit(&self, d: usize) -> usize {
        (self.w[d / 8] >> (56 - 8 * (d % 8))) as usize & 0xff
    }
}

/// Entries `lo..hi` agree on every key byte before `offset` and are still
/// to be ordered by the rest.
#[derive(Clone, Copy, Debug)]
struct Job {
    lo: usize,
    hi: usize,
    offset: usize,
}

enum Phase {
    /// Index slots from `slot` on are still to be collected.
    Collect {
        slot: usize,
    },
    /// Takes the next job (or ends).
    Next,
    /// Windows of the job's entries from `pos` on are still to be loaded
    /// (and their digits counted).
    Load {
        job: Job,
        pos: usize,
    },
    /// Radix pass `pass` (an index into `Sort::digits`), entries from
    /// `pos` on still to be placed; `in_b`: the pass reads `b`.
    Pass {
        job: Job,
        pass: usize,
        pos: usize,
        in_b: bool,
    },
    /// The job's entries from `pos` on are still to be copied back from
    /// `b` (after an odd number of passes).
    CopyBack {
        job: Job,
        pos: usize,
    },
    /// Runs of equal windows from `pos` on (a run begun at `run`) are
    /// still to be found and queued as jobs at the next window.
    Ties {
        job: Job,
        pos: usize,
        run: usize,
    },
    Done,
}

/// A sort in progress (see the module doc).
pub struct Sort {
    a: Vec<Entry>,
    b: Vec<Entry>,
    /// Per digit of the current job's window, how many entries have each
    /// byte value.
    counts: Box<[[u32; 256]; DIGITS]>,
    /// The digits the current job's passes place by, least significant
    /// first (those on which its entries differ).
    digits: Vec<usize>,
    /// Where the current pass places the next entry of each byte value.
    next: Box<[usize; 256]>,
    jobs: Vec<Job>,
    phase: Phase,
}

/// Live records' addresses in key order (see [`Sort`]).
pub struct Sorted {
    order: Vec<Entry>,
    spare: Vec<Entry>,
}

/// Bytes a sort holds per key: its two entry buffers.
pub const BYTES_PER_KEY: usize = 2 * std::mem::size_of::<Entry>();

/// A sort's memory, kept for the next one: fresh pages cost a kernel
/// zero-fill on first touch (on this project's VM ~4 ms per 2 MiB),
/// which a flush would otherwise pay on the shard for two buffers of
/// 32 bytes per key each time.
#[derive(Default)]
pub struct Buffers {
    a: Vec<Entry>,
    b: Vec<Entry>,
}

impl Buffers {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        bytes_of(&self.a, &self.b)
    }
}

/// Bytes two entry buffers hold (their capacity: what was allocated).
fn bytes_of(a: &Vec<Entry>, b: &Vec<Entry>) -> usize {
    (a.capacity() + b.capacity()) * std::mem::size_of::<Entry>()
}

impl Sorted {
    /// The address of the `i`th record in key order.
    #[inline]
    pub fn get(&self, i: usize) -> Option<u64> {
        self.order.get(i).map(|e| e.addr)
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        bytes_of(&self.order, &self.spare)
    }

    /// The memory, for the next sort: none if it is more than twice what
    /// this sort needed (kept buffers never hold more than that, and
    /// shrinking them in place would copy them on the shard).
    pub fn into_buffers(self) -> Buffers {
        if self.order.capacity() > 2 * self.order.len().max(1 << 12) {
            return Buffers::default();
        }
        Buffers {
            a: self.order,
            b: self.spare,
        }
    }
}

impl Sort {
    /// A sort of `mem`'s live records in `buffers` (grown as needed);
    /// nothing is done until [`Sort::step`].
    pub fn new(mem: &Memtable, buffers: Buffers) -> Sort {
        let Buffers { mut a, mut b } = buffers;
        a.clear();
        b.clear();
        a.reserve(mem.len());
        b.reserve(mem.len());
        Sort {
            a,
            b,
            counts: Box::new([[0; 256]; DIGITS]),
            digits: Vec::new(),
            next: Box::new([0; 256]),
            jobs: Vec::new(),
            phase: Phase::Collect { slot: 0 },
        }
    }

    /// Does at most about `work` units of work (an entry loaded, placed,
    /// copied or compared; a few index slots scanned). True once sorted.
    /// `mem` must be the memtable the sort was made for, unchanged.
    pub fn step(&mut self, mem: &Memtable, work: usize) -> bool {
        let mut left = work.max(1);
        while left > 0 {
            left = match self.phase {
                Phase::Done => return true,
                Phase::Collect { slot } => self.collect(mem, slot, left),
                Phase::Next => self.next_job(mem, left),
                Phase::Load { job, pos } => self.load(mem, job, pos, left),
                Phase::Pass {
                    job,
                    pass,
                    pos,
                    in_b,
                } => self.pass(job, pass, pos, in_b, left),
                Phase::CopyBack { job, pos } => self.copy_back(job, pos, left),
                Phase::Ties { job, pos, run } => self.ties(job, pos, run, left),
            };
        }
        matches!(self.phase, Phase::Done)
    }

    /// Bytes held (the entries and the passes' second buffer: 64 per
    /// live key).
    pub fn bytes(&self) -> usize {
        bytes_of(&self.a, &self.b)
    }

    /// The order, once [`Sort::step`] said it is done.
    pub fn take_sorted(&mut self) -> Sorted {
        debug_assert!(matches!(self.phase, Phase::Done));
        Sorted {
            order: std::mem::take(&mut self.a),
            spare: std::mem::take(&mut self.b),
        }
    }

    fn collect(&mut self, mem: &Memtable, slot: usize, left: usize) -> usize {
        let end = mem
            .slot_count()
            .min(slot.saturating_add(left.saturating_mul(SLOTS_PER_UNIT)));
        self.a.extend(
            mem.live_addrs_in(slot..end)
                .map(|addr| Entry { w: [0; 3], addr }),
        );
        // The passes' second buffer grows with the entries, a step at a
        // time.
        self.b.resize(self.a.len(), Entry::default());
        self.phase = if end == mem.slot_count() {
            let n = self.a.len();
            self.jobs.push(Job {
                lo: 0,
                hi: n,
                offset: 0,
            });
            Phase::Next
        } else {
            Phase::Collect { slot: end }
        };
        left - (end - slot).div_ceil(SLOTS_PER_UNIT)
    }

    fn next_job(&mut self, mem: &Memtable, left: usize) -> usize {
        let Some(job) = self.jobs.pop() else {
            self.phase = Phase::Done;
            return 0;
        };
        let n = job.hi - job.lo;
        if n <= SMALL {
            // Comparing whole keys is cheaper than a round here.
            self.a[job.lo..job.hi]
                .sort_unstable_by(|x, y| mem.key_of(x.addr).cmp(mem.key_of(y.addr)));
            return left.saturating_sub(n * n);
        }
        for c in self.counts.iter_mut() {
            c.fill(0);
        }
        self.phase = Phase::Load { job, pos: job.lo };
        left.saturating_sub(DIGITS * 256 / 64)
    }

    fn load(&mut self, mem: &Memtable, job: Job, pos: usize, left: usize) -> usize {
        let end = job.hi.min(pos.saturating_add(left));
        for i in pos..end {
            if let Some(e) = self.a.get(i + AHEAD).filter(|_| i + AHEAD < job.hi) {
                mem.prefetch_key(e.addr);
            }
            let e = &mut self.a[i];
            let key = mem.key_of(e.addr);
            let mut win = [0u8; DIGITS];
            let rest = key.get(job.offset..).unwrap_or(&[]);
            let n = rest.len().min(WINDOW);
            win[..n].copy_from_slice(&rest[..n]);
            win[WINDOW] = rest.len().min(WINDOW + 1) as u8;
            for (w, bytes) in e.w.iter_mut().zip(win.chunks_exact(8)) {
                *w = u64::from_be_bytes(bytes.try_into().expect("8 bytes"));
            }
            for (c, &b) in self.counts.iter_mut().zip(&win) {
                c[b as usize] += 1;
            }
        }
        if end < job.hi {
            self.phase = Phase::Load { job, pos: end };
            return left - (end - pos);
        }
        // The digits on which entries differ, least significant first.
        let n = (job.hi - job.lo) as u32;
        self.digits.clear();
        self.digits
            .extend((0..DIGITS).rev().filter(|&d| !self.counts[d].contains(&n)));
        self.start_pass(job, 0, false);
        left - (end - pos)
    }

    /// Begins pass `pass` of `job` (or what follows the last).
    fn start_pass(&mut self, job: Job, pass: usize, in_b: bool) {
        let Some(&d) = self.digits.get(pass) else {
            self.phase = if in_b {
                Phase::CopyBack { job, pos: job.lo }
            } else {
                Phase::Ties {
                    job,
                    pos: job.lo,
                    run: job.lo,
                }
            };
            return;
        };
        let mut at = job.lo;
        for (next, &c) in self.next.iter_mut().zip(self.counts[d].iter()) {
            *next = at;
            at += c as usize;
        }
        self.phase = Phase::Pass {
            job,
            pass,
            pos: job.lo,
            in_b,
        };
    }

    fn pass(&mut self, job: Job, pass: usize, pos: usize, in_b: bool, left: usize) -> usize {
        let d = self.digits[pass];
        let end = job.hi.min(pos.saturating_add(left));
        let (from, to) = if in_b {
            (&self.b, &mut self.a)
        } else {
            (&self.a, &mut self.b)
        };
        for e in &from[pos..end] {
            let slot = &mut self.next[e.digit(d)];
            to[*slot] = *e;
            *slot += 1;
        }
        if end < job.hi {
            self.phase = Phase::Pass {
                job,
                pass,
                pos: end,
                in_b,
            };
        } else {
            self.start_pass(job, pass + 1, !in_b);
        }
        left - (end - pos)
    }

    fn copy_back(&mut self, job: Job, pos: usize, left: usize) -> usize {
        let end = job.hi.min(pos.saturating_add(left));
        self.a[pos..end].copy_from_slice(&self.b[pos..end]);
        self.phase = if end < job.hi {
            Phase::CopyBack { job, pos: end }
        } else {
            Phase::Ties {
                job,
                pos: job.lo,
                run: job.lo,
            }
        };
        left - (end - pos)
    }

    fn ties(&mut self, job: Job, pos: usize, run: usize, left: usize) -> usize {
        let end = job.hi.min(pos.saturating_add(left));
        let mut run = run;
        for i in pos..end {
            if self.a[i].w != self.a[run].w {
                self.queue_run(run, i, job.offset);
                run = i;
            }
        }
        if end < job.hi {
            self.phase = Phase::Ties { job, pos: end, run };
        } else {
            self.queue_run(run, job.hi, job.offset);
            self.phase = Phase::Next;
        }
        left.saturating_sub((end - pos).max(1))
    }

    /// Entries `lo..hi` share the window at `offset`: every key goes on
    /// past it (see the module doc), so the next window orders them.
    fn queue_run(&mut self, lo: usize, hi: usize, offset: usize) {
        if hi - lo > 1 {
            // Live keys are distinct: a shared window always says more
            // bytes follow, or the next round would never end.
            debug_assert_eq!(
                self.a[lo].digit(WINDOW),
                WINDOW + 1,
                "equal keys in one memtable"
            );
            self.jobs.push(Job {
                lo,
                hi,
                offset: offset + WINDOW,
            });
        }
    }
}

/// The address of every live key's newest record, in ascending key order,
/// sorted in one go.
#[cfg(test)]
pub fn sorted_live(mem: &Memtable) -> Sorted {
    let mut s = Sort::new(mem, Buffers::default());
    while !s.step(mem, usize::MAX / 2) {}
    s.take_sorted()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bloom::hash;
    use crate::format::Kind;

    fn keys_of(m: &Memtable, s: &Sorted) -> Vec<Vec<u8>> {
        (0..s.len())
            .map(|i| m.key_of(s.get(i).expect("in range")).to_vec())
            .collect()
    }

    fn memtable(keys: &[Vec<u8>]) -> Memtable {
        let mut m = Memtable::new(1024);
        for k in keys.iter().rev() {
            m.write(Kind::Put, k, hash(k), b"v");
        }
        m
    }

    #[test]
    fn keys_come_out_in_byte_order_whatever_their_shared_prefixes() {
        let mut keys: Vec<Vec<u8>> = Vec::new();
        // Keys sharing one and two whole windows, shorter than a window,
        // ending at a window's edge, and with zero bytes where a shorter
        // key is padded.
        for i in 0u32..5000 {
            for shared in [20, 23, 46, 50] {
                let mut k = vec![7u8; shared];
                k.extend_from_slice(&i.wrapping_mul(2_654_435_761).to_be_bytes());
                keys.push(k);
            }
            keys.push(i.to_le_bytes()[..(i % 4 + 1) as usize].to_vec());
            keys.push(vec![7u8; (i % 60) as usize + 1]);
        }
        for n in 0..50 {
            let mut k = vec![1, 2];
            k.resize(2 + n, 0);
            keys.push(k);
        }
        keys.sort();
        keys.dedup();
        let m = memtable(&keys);
        assert_eq!(keys_of(&m, &sorted_live(&m)), keys);
    }

    #[test]
    fn a_sort_in_the_smallest_steps_gives_the_same_order() {
        let mut keys: Vec<Vec<u8>> = (0u32..3000)
            .map(|i| {
                let mut k = vec![9u8; (i % 40) as usize];
                k.extend_from_slice(&i.wrapping_mul(40_503).to_be_bytes());
                k
            })
            .collect();
        keys.sort();
        keys.dedup();
        let m = memtable(&keys);
        let mut s = Sort::new(&m, Buffers::default());
        let mut steps = 0;
        while !s.step(&m, 1) {
            steps += 1;
        }
        assert!(steps > keys.len(), "{steps} steps: the work was not split");
        assert_eq!(keys_of(&m, &s.take_sorted()), keys);
    }

    #[test]
    fn an_empty_memtable_sorts_to_nothing() {
        let m = Memtable::new(1024);
        assert!(sorted_live(&m).is_empty());
    }
}
