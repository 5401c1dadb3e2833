//! Both ends of a session segment: the client's (submits, reaps, provides
//! buffers) and the daemon's (drains, completes, takes buffers).

use std::marker::PhantomData;

use stator_shm::arena::ArenaRegion;
use stator_shm::{OutOfBounds, ShmView};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::bufring::{BadBuffer, BufEntry, ProvidedBuf};
use crate::cqe::Cqe;
use crate::header::{AttachError, RingLayout, RingParams, word};
use crate::queue::{Consumer, Indices, Producer, QueueError, Slots};
use crate::sqe::Sqe;
use crate::sync::AtomicU32;

/// The shared word at control-page offset `off` as an atomic.
///
/// Panics only if `off` is not one of the fixed, aligned offsets of
/// [`word`] inside the control page, which every caller passes.
pub(crate) fn shared_word<'a>(view: &ShmView<'a>, off: usize) -> &'a AtomicU32 {
    let p = view
        .atomic_u32(off)
        .expect("shared words are fixed, aligned offsets inside the 4 KiB control page");
    // SAFETY: `p` is aligned and in bounds of a mapping that lives for 'a.
    // The memory is shared with the peer, which may write it at any time;
    // that is what atomics are for, and we only ever access it atomically.
    unsafe { AtomicU32::from_ptr(p.as_ptr()) }
}

/// Queue slots in shared memory, copied in and out with volatile accesses.
pub struct ShmSlots<'a, T> {
    view: ShmView<'a>,
    mask: u32,
    _t: PhantomData<fn(T) -> T>,
}

impl<'a, T> ShmSlots<'a, T> {
    /// Slots of `entries` elements starting at `off` of `view`.
    pub fn new(view: &ShmView<'a>, off: usize, entries: u32) -> Result<Self, OutOfBounds> {
        let len = (entries as usize).saturating_mul(size_of::<T>());
        let view = view.subview(off, len)?;
        assert!(
            entries.is_power_of_two(),
            "entries {entries} not a power of two"
        );
        Ok(ShmSlots {
            view,
            mask: entries - 1,
            _t: PhantomData,
        })
    }
}

impl<T: FromBytes + IntoBytes + Immutable> Slots<T> for ShmSlots<'_, T> {
    fn capacity(&self) -> u32 {
        self.mask + 1
    }

    #[inline]
    fn store(&self, pos: u32, v: &T) {
        let off = (pos & self.mask) as usize * size_of::<T>();
        self.view
            .write(off, v)
            .expect("a masked slot offset lies inside the slot view checked in ShmSlots::new");
    }

    #[inline]
    fn load(&self, pos: u32) -> T {
        let off = (pos & self.mask) as usize * size_of::<T>();
        self.view
            .read(off)
            .expect("a masked slot offset lies inside the slot view checked in ShmSlots::new")
    }
}

fn indices<'a>(view: &ShmView<'a>, head: usize, tail: usize, cs: usize, ps: usize) -> Indices<'a> {
    Indices {
        head: shared_word(view, head),
        tail: shared_word(view, tail),
        consumer_sleeping: shared_word(view, cs),
        producer_sleeping: shared_word(view, ps),
    }
}

type Sq<'a> = ShmSlots<'a, Sqe>;
type Cq<'a> = ShmSlots<'a, Cqe>;
type Br<'a> = ShmSlots<'a, BufEntry>;

fn sq_parts<'a>(view: &ShmView<'a>, l: &RingLayout) -> (Indices<'a>, Sq<'a>) {
    let ix = indices(
        view,
        word::SQ_HEAD,
        word::SQ_TAIL,
        word::SQ_CONSUMER_SLEEPING,
        word::SQ_PRODUCER_SLEEPING,
    );
    let slots = ShmSlots::new(view, l.sq_off, l.params.sq_entries)
        .expect("the SQ lies inside a segment whose length attach/init checked");
    (ix, slots)
}

fn cq_parts<'a>(view: &ShmView<'a>, l: &RingLayout) -> (Indices<'a>, Cq<'a>) {
    let ix = indices(
        view,
        word::CQ_HEAD,
        word::CQ_TAIL,
        word::CQ_CONSUMER_SLEEPING,
        word::CQ_PRODUCER_SLEEPING,
    );
    let slots = ShmSlots::new(view, l.cq_off, l.params.cq_entries)
        .expect("the CQ lies inside a segment whose length attach/init checked");
    (ix, slots)
}

fn br_parts<'a>(view: &ShmView<'a>, l: &RingLayout) -> Option<(Indices<'a>, Br<'a>)> {
    if l.params.buf_entries == 0 {
        return None;
    }
    let ix = indices(
        view,
        word::BUF_HEAD,
        word::BUF_TAIL,
        word::BUF_CONSUMER_SLEEPING,
        word::BUF_PRODUCER_SLEEPING,
    );
    let slots = ShmSlots::new(view, l.buf_off, l.params.buf_entries)
        .expect("the buffer ring lies inside a segment whose length attach/init checked");
    Some((ix, slots))
}

/// Errors setting up either end.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error(transparent)]
    Layout(#[from] crate::header::LayoutError),
    #[error("queue indices in the segment are inconsistent: {0}")]
    Queue(#[from] QueueError),
}

/// The client's end: produces descriptors, consumes completions, provides
/// result buffers.
pub struct ClientRing<'a> {
    view: ShmView<'a>,
    layout: RingLayout,
    pub sq: Producer<'a, Sqe, Sq<'a>>,
    pub cq: Consumer<'a, Cqe, Cq<'a>>,
    pub bufs: Option<Producer<'a, BufEntry, Br<'a>>>,
}

impl<'a> ClientRing<'a> {
    /// Attaches to a segment the daemon created and initialized.
    pub fn attach(view: ShmView<'a>) -> Result<Self, RingError> {
        let layout = RingLayout::attach(&view)?;
        let (ix, s) = sq_parts(&view, &layout);
        let sq = Producer::new(ix, s)?;
        let (ix, s) = cq_parts(&view, &layout);
        let cq = Consumer::new(ix, s)?;
        let bufs = match br_parts(&view, &layout) {
            Some((ix, s)) => Some(Producer::new(ix, s)?),
            None => None,
        };
        Ok(ClientRing {
            view,
            layout,
            sq,
            cq,
            bufs,
        })
    }

    /// The layout read from the header at attach.
    pub fn layout(&self) -> &RingLayout {
        &self.layout
    }

    /// The arena, arena-relative (offset 0 is the arena's first byte).
    pub fn arena(&self) -> ShmView<'a> {
        self.view
            .subview(self.layout.arena.base, self.layout.arena.len)
            .expect("the arena lies inside the segment (checked at attach)")
    }

    /// Whether the daemon marked the session closing (or broken).
    pub fn daemon_closing(&self) -> bool {
        // Relaxed: a hint; the control socket is the authority on closing.
        shared_word(&self.view, word::STATE).load(crate::sync::Ordering::Relaxed)
            != crate::header::state::OPEN
    }

    /// Whether the daemon found the queue protocol broken and stopped
    /// serving the session (the reason follows on the control socket).
    pub fn daemon_broken(&self) -> bool {
        shared_word(&self.view, word::STATE).load(crate::sync::Ordering::Relaxed)
            == crate::header::state::BROKEN
    }
}

/// Why a provided buffer could not be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TakeBufError {
    #[error("the session has no provided-buffer ring")]
    NoRing,
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Bad(#[from] BadBuffer),
}

/// The daemon's end: consumes descriptors, produces completions, takes
/// provided buffers. It never re-reads the header after `create`.
pub struct DaemonRing<'a> {
    view: ShmView<'a>,
    layout: RingLayout,
    pub sq: Consumer<'a, Sqe, Sq<'a>>,
    pub cq: Producer<'a, Cqe, Cq<'a>>,
    pub bufs: Option<Consumer<'a, BufEntry, Br<'a>>>,
}

impl<'a> DaemonRing<'a> {
    /// Initializes a fresh, zeroed segment with `params` and returns the
    /// daemon's end of it.
    pub fn create(view: ShmView<'a>, params: RingParams) -> Result<Self, RingError> {
        let layout = RingLayout::new(params)?;
        layout.init(&view)?;
        let (ix, s) = sq_parts(&view, &layout);
        let sq = Consumer::new(ix, s)?;
        let (ix, s) = cq_parts(&view, &layout);
        let cq = Producer::new(ix, s)?;
        let bufs = match br_parts(&view, &layout) {
            Some((ix, s)) => Some(Consumer::new(ix, s)?),
            None => None,
        };
        Ok(DaemonRing {
            view,
            layout,
            sq,
            cq,
            bufs,
        })
    }

    /// The layout this end created.
    pub fn layout(&self) -> &RingLayout {
        &self.layout
    }

    /// The arena's bounds, for validating descriptors.
    pub fn arena(&self) -> &ArenaRegion {
        &self.layout.arena
    }

    /// The whole segment (for copying keys in and results out by segment
    /// offset, after validation).
    pub fn view(&self) -> &ShmView<'a> {
        &self.view
    }

    /// Takes the next provided buffer. `Ok(None)`: none available. A buffer
    /// outside the arena is consumed and reported; the caller answers the
    /// request with `BadBuffer`.
    pub fn take_buffer(&mut self) -> Result<Option<ProvidedBuf>, TakeBufError> {
        let ring = self.bufs.as_mut().ok_or(TakeBufError::NoRing)?;
        let Some(e) = ring.pop()? else {
            return Ok(None);
        };
        Ok(Some(e.validate(&self.layout.arena)?))
    }

    /// Marks the session closing (clients see it in `daemon_closing`),
    /// unless it is broken.
    pub fn mark_closing(&self) {
        // Relaxed: a hint; see `ClientRing::daemon_closing`.
        // (The daemon is the only writer that counts: a client that writes
        // its own STATE word only misleads itself.)
        let w = shared_word(&self.view, word::STATE);
        if w.load(crate::sync::Ordering::Relaxed) == crate::header::state::OPEN {
            w.store(
                crate::header::state::CLOSING,
                crate::sync::Ordering::Relaxed,
            );
        }
    }

    /// Marks the session broken (`ClientRing::daemon_broken`).
    pub fn mark_broken(&self) {
        shared_word(&self.view, word::STATE)
            .store(crate::header::state::BROKEN, crate::sync::Ordering::Relaxed);
    }
}
