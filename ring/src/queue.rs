//! The single-producer, single-consumer queue protocol shared by the
//! submission queue, the completion queue and the provided-buffer ring.
//!
//! Each queue has four shared words, each on its own cache line:
//! `head` (written only by the consumer), `tail` (written only by the
//! producer), and two sleep flags (`consumer_sleeping`, set by a consumer
//! about to sleep, and `producer_sleeping`, set by a producer waiting for
//! space). Indices are free-running `u32`s; a slot is `index & (capacity-1)`.
//! Each side keeps a private copy of its own index and a cached copy of the
//! other's, so the fast path touches the shared lines once per batch.
//!
//! The peer is untrusted: an index it publishes is validated before use, and
//! a bad one is a [`QueueError`], never a panic or an out-of-bounds access.
//! Slot contents are copied in and out by a [`Slots`] implementation
//! (volatile copies into shared memory in production, loom cells in the
//! model checks); validating their contents is the caller's business.
//!
//! Memory ordering (the argument is repeated in `ring/PROTOCOL.md`):
//! - producer: write slots, then `tail.store(Release)`; consumer:
//!   `tail.load(Acquire)`, then read slots. So every slot below `tail` is
//!   fully written before the consumer reads it.
//! - consumer: read slots, then `head.store(Release)`; producer:
//!   `head.load(Acquire)`, then overwrite slots. So a slot is never
//!   overwritten while the consumer still copies it out.
//! - sleeping (Dekker): the sleeper stores its flag, `fence(SeqCst)`, then
//!   re-reads the other index; the waker stores its index, `fence(SeqCst)`,
//!   then reads the flag. The two fences are totally ordered, so at least one
//!   side sees the other's store: either the sleeper sees the new index and
//!   does not sleep, or the waker sees the flag and rings the doorbell. No
//!   wakeup is lost; the loom tests check exactly this.

use std::marker::PhantomData;

use crate::sync::{AtomicU32, Ordering, fence};

/// Where a queue's entries live.
pub trait Slots<T> {
    /// Number of slots (a power of two).
    fn capacity(&self) -> u32;
    /// Copies `v` into slot `pos & (capacity - 1)`.
    fn store(&self, pos: u32, v: &T);
    /// Copies slot `pos & (capacity - 1)` out.
    fn load(&self, pos: u32) -> T;
}

/// The four shared words of one queue.
#[derive(Clone, Copy)]
pub struct Indices<'a> {
    pub head: &'a AtomicU32,
    pub tail: &'a AtomicU32,
    pub consumer_sleeping: &'a AtomicU32,
    pub producer_sleeping: &'a AtomicU32,
}

/// The peer published an index that no correct peer could have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error(
        "peer published tail {tail} with our head at {head} (released {released}): more than capacity {capacity} entries or behind us"
    )]
    BadTail {
        head: u32,
        released: u32,
        tail: u32,
        capacity: u32,
    },
    #[error(
        "peer published head {head}, not between its previous value {previous} and our tail {tail}"
    )]
    BadHead { previous: u32, head: u32, tail: u32 },
}

/// The producing side of a queue.
pub struct Producer<'a, T, S: Slots<T>> {
    ix: Indices<'a>,
    slots: S,
    capacity: u32,
    /// Next position to write (private; published as `tail`).
    tail: u32,
    /// Last `tail` stored to shared memory.
    published: u32,
    /// Last validated `head` read from the consumer.
    head: u32,
    _t: PhantomData<fn(T)>,
}

impl<'a, T, S: Slots<T>> Producer<'a, T, S> {
    /// A producer over a queue whose indices both start at the values in
    /// memory (zero for a fresh segment).
    pub fn new(ix: Indices<'a>, slots: S) -> Result<Self, QueueError> {
        let capacity = slots.capacity();
        assert!(
            capacity.is_power_of_two(),
            "slot capacity {capacity} is not a power of two"
        );
        // Relaxed: at construction no entries are in flight; `tail` is ours
        // and `head` is validated against it below.
        let tail = ix.tail.load(Ordering::Relaxed);
        let head = ix.head.load(Ordering::Acquire);
        if tail.wrapping_sub(head) > capacity {
            return Err(QueueError::BadHead {
                previous: head,
                head,
                tail,
            });
        }
        Ok(Producer {
            ix,
            slots,
            capacity,
            tail,
            published: tail,
            head,
            _t: PhantomData,
        })
    }

    /// Capacity in entries.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn refresh_head(&mut self) -> Result<(), QueueError> {
        // SYNC POINT. Acquire: pairs with the consumer's Release store of
        // `head`; its copies out of the slots below `head` happen before we
        // overwrite them.
        let head = self.ix.head.load(Ordering::Acquire);
        // A correct consumer only moves head forward, and never past our
        // published tail.
        if head.wrapping_sub(self.head) > self.published.wrapping_sub(self.head) {
            return Err(QueueError::BadHead {
                previous: self.head,
                head,
                tail: self.published,
            });
        }
        self.head = head;
        Ok(())
    }

    /// Free slots, re-reading the consumer's head only when the cached one
    /// says the queue is full.
    #[inline]
    pub fn free(&mut self) -> Result<u32, QueueError> {
        let used = self.tail.wrapping_sub(self.head);
        if used < self.capacity {
            return Ok(self.capacity - used);
        }
        self.refresh_head()?;
        Ok(self.capacity - self.tail.wrapping_sub(self.head))
    }

    /// Free slots, always re-reading the consumer's head (for a caller
    /// that reserves slots ahead and must not under-count).
    pub fn free_now(&mut self) -> Result<u32, QueueError> {
        self.refresh_head()?;
        Ok(self.capacity - self.tail.wrapping_sub(self.head))
    }

    /// Writes `v` into the next slot without publishing it. `Ok(false)` when
    /// the queue is full.
    #[inline]
    pub fn push(&mut self, v: &T) -> Result<bool, QueueError> {
        if self.free()? == 0 {
            return Ok(false);
        }
        self.slots.store(self.tail, v);
        self.tail = self.tail.wrapping_add(1);
        Ok(true)
    }

    /// Our private tail: the position of the next entry we write.
    pub fn position(&self) -> u32 {
        self.tail
    }

    /// Entries pushed but not yet published.
    pub fn unpublished(&self) -> u32 {
        self.tail.wrapping_sub(self.published)
    }

    /// Entries published and not yet released by the consumer, as last seen.
    pub fn in_queue(&self) -> u32 {
        self.published.wrapping_sub(self.head)
    }

    /// Makes every pushed entry visible to the consumer with one store.
    /// Returns true when the consumer said it sleeps: the caller must then
    /// ring the consumer's doorbell.
    #[inline]
    pub fn publish(&mut self) -> bool {
        if self.tail == self.published {
            return false;
        }
        // SYNC POINT. Release: the slot writes above happen before a consumer
        // that Acquire-loads this tail reads them.
        self.ix.tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
        // SYNC POINT. SeqCst fence between our tail store and our read of the
        // sleep flag: pairs with the fence in `Consumer::prepare_sleep`
        // (Dekker), so either it sees our tail or we see its flag.
        fence(Ordering::SeqCst);
        // Relaxed: the fence orders the load; swap makes exactly one waker.
        self.ix.consumer_sleeping.load(Ordering::Relaxed) != 0
            && self.ix.consumer_sleeping.swap(0, Ordering::Relaxed) != 0
    }

    /// Announces that this producer is about to sleep until space frees up.
    /// Returns `Ok(true)` when space appeared meanwhile (do not sleep; the
    /// flag is already cleared). Otherwise the caller sleeps on its doorbell
    /// and calls [`Self::end_wait`] when it wakes.
    pub fn prepare_wait(&mut self) -> Result<bool, QueueError> {
        // Relaxed store: ordered before the head load by the fence.
        self.ix.producer_sleeping.store(1, Ordering::Relaxed);
        // SYNC POINT. Pairs with the fence in `Consumer::release`.
        fence(Ordering::SeqCst);
        self.refresh_head()?;
        if self.tail.wrapping_sub(self.head) < self.capacity {
            self.end_wait();
            return Ok(true);
        }
        Ok(false)
    }

    /// Clears the producer's sleep flag.
    pub fn end_wait(&self) {
        // Relaxed: only a hint to the consumer; a stale 1 costs it one
        // needless doorbell write.
        self.ix.producer_sleeping.store(0, Ordering::Relaxed);
    }
}

/// The consuming side of a queue.
pub struct Consumer<'a, T, S: Slots<T>> {
    ix: Indices<'a>,
    slots: S,
    capacity: u32,
    /// Next position to read (private; published as `head` on release).
    head: u32,
    /// Last `head` stored to shared memory.
    released: u32,
    /// Last validated `tail` read from the producer.
    tail: u32,
    _t: PhantomData<fn() -> T>,
}

impl<'a, T, S: Slots<T>> Consumer<'a, T, S> {
    /// A consumer over a queue whose indices start at the values in memory.
    pub fn new(ix: Indices<'a>, slots: S) -> Result<Self, QueueError> {
        let capacity = slots.capacity();
        assert!(
            capacity.is_power_of_two(),
            "slot capacity {capacity} is not a power of two"
        );
        // Relaxed: `head` is ours; `tail` is validated by the first refresh.
        let head = ix.head.load(Ordering::Relaxed);
        Ok(Consumer {
            ix,
            slots,
            capacity,
            head,
            released: head,
            tail: head,
            _t: PhantomData,
        })
    }

    /// Capacity in entries.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn refresh_tail(&mut self) -> Result<u32, QueueError> {
        // SYNC POINT. Acquire: pairs with the producer's Release store of
        // `tail`; the slots below it are fully written before we read them.
        let tail = self.ix.tail.load(Ordering::Acquire);
        // A correct producer never runs more than `capacity` ahead of what we
        // released, and never moves tail back behind what we already read.
        let outstanding = tail.wrapping_sub(self.released);
        if outstanding > self.capacity || tail.wrapping_sub(self.head) > outstanding {
            return Err(QueueError::BadTail {
                head: self.head,
                released: self.released,
                tail,
                capacity: self.capacity,
            });
        }
        self.tail = tail;
        Ok(tail.wrapping_sub(self.head))
    }

    /// Entries ready to pop, re-reading the producer's tail only when the
    /// cached one says the queue is empty.
    #[inline]
    pub fn available(&mut self) -> Result<u32, QueueError> {
        let n = self.tail.wrapping_sub(self.head);
        if n > 0 {
            return Ok(n);
        }
        self.refresh_tail()
    }

    /// Copies the next entry out. Its slot stays reserved until
    /// [`Self::release`].
    #[inline]
    pub fn pop(&mut self) -> Result<Option<T>, QueueError> {
        if self.available()? == 0 {
            return Ok(None);
        }
        let v = self.slots.load(self.head);
        self.head = self.head.wrapping_add(1);
        Ok(Some(v))
    }

    /// Our private head: the position of the next entry we read.
    pub fn position(&self) -> u32 {
        self.head
    }

    /// Puts back the last `n` entries popped and not yet released: the
    /// next pops return them again (read afresh from their slots, which
    /// stay reserved until released). For a consumer that took more than
    /// it can serve now (statord, when writes would pass its memory
    /// budget).
    pub fn unpop(&mut self, n: u32) {
        assert!(
            n <= self.unreleased(),
            "unpop({n}) with {} entries popped and not released",
            self.unreleased()
        );
        self.head = self.head.wrapping_sub(n);
    }

    /// Entries popped but not yet released.
    pub fn unreleased(&self) -> u32 {
        self.head.wrapping_sub(self.released)
    }

    /// Hands every popped slot back to the producer with one store. Returns
    /// true when the producer said it waits for space: the caller must then
    /// ring the producer's doorbell.
    #[inline]
    pub fn release(&mut self) -> bool {
        if self.head == self.released {
            return false;
        }
        // SYNC POINT. Release: our copies out of the slots happen before a
        // producer that Acquire-loads this head overwrites them.
        self.ix.head.store(self.head, Ordering::Release);
        self.released = self.head;
        // SYNC POINT. Pairs with the fence in `Producer::prepare_wait`.
        fence(Ordering::SeqCst);
        // Relaxed: ordered by the fence; swap makes exactly one waker.
        self.ix.producer_sleeping.load(Ordering::Relaxed) != 0
            && self.ix.producer_sleeping.swap(0, Ordering::Relaxed) != 0
    }

    /// Announces that this consumer is about to sleep. Returns `Ok(true)`
    /// when entries arrived meanwhile (do not sleep; the flag is cleared).
    /// Otherwise the caller sleeps on its doorbell and calls
    /// [`Self::end_sleep`] when it wakes.
    pub fn prepare_sleep(&mut self) -> Result<bool, QueueError> {
        // Relaxed store: ordered before the tail load by the fence.
        self.ix.consumer_sleeping.store(1, Ordering::Relaxed);
        // SYNC POINT. Pairs with the fence in `Producer::publish` (Dekker).
        fence(Ordering::SeqCst);
        if self.refresh_tail()? > 0 {
            self.end_sleep();
            return Ok(true);
        }
        Ok(false)
    }

    /// Clears the consumer's sleep flag.
    pub fn end_sleep(&self) {
        // Relaxed: a stale 1 costs the producer one needless doorbell write.
        self.ix.consumer_sleeping.store(0, Ordering::Relaxed);
    }
}
