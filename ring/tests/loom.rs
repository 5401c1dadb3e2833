//! loom model checks of the queue and doorbell protocol.
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p stator-ring --test loom --release`
//! (`.ci/run` does, in its own target directory).
//!
//! The queue code under test is the production code: under `--cfg loom`,
//! `stator_ring::sync` is loom's atomics. Slots are loom `UnsafeCell`s, so
//! loom also reports a data race if the Acquire/Release pairs were too weak
//! to order a slot write before its read (or a read before its reuse). The
//! doorbell is a loom mutex + condvar; a lost wakeup leaves the sleeper
//! blocked forever, which loom reports as a deadlock.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use stator_ring::queue::{Consumer, Indices, Producer, Slots};
use stator_ring::sync::AtomicU32;

struct Shared {
    words: [AtomicU32; 4],
    slots: Vec<UnsafeCell<u64>>,
}

impl Shared {
    fn new(cap: usize) -> Arc<Shared> {
        Arc::new(Shared {
            words: std::array::from_fn(|_| AtomicU32::new(0)),
            slots: (0..cap).map(|_| UnsafeCell::new(0)).collect(),
        })
    }

    fn indices(&self) -> Indices<'_> {
        Indices {
            head: &self.words[0],
            tail: &self.words[1],
            consumer_sleeping: &self.words[2],
            producer_sleeping: &self.words[3],
        }
    }
}

struct CellSlots<'a>(&'a [UnsafeCell<u64>]);

impl Slots<u64> for CellSlots<'_> {
    fn capacity(&self) -> u32 {
        self.0.len() as u32
    }
    fn store(&self, pos: u32, v: &u64) {
        let i = pos as usize & (self.0.len() - 1);
        self.0[i].with_mut(|p| {
            // SAFETY: loom checks that no other access to this cell is
            // concurrent; that is the property under test.
            unsafe { *p = *v }
        });
    }
    fn load(&self, pos: u32) -> u64 {
        let i = pos as usize & (self.0.len() - 1);
        self.0[i].with(|p| {
            // SAFETY: as in `store`.
            unsafe { *p }
        })
    }
}

/// A doorbell: a counter behind a mutex, a condvar to sleep on.
#[derive(Default)]
struct Bell {
    rung: Mutex<bool>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        *self.rung.lock().unwrap() = true;
        self.cv.notify_one();
    }
    fn wait(&self) {
        let mut g = self.rung.lock().unwrap();
        while !*g {
            g = self.cv.wait(g).unwrap();
        }
        *g = false;
    }
}

fn producer(s: &Shared) -> Producer<'_, u64, CellSlots<'_>> {
    Producer::new(s.indices(), CellSlots(&s.slots)).unwrap()
}

fn consumer(s: &Shared) -> Consumer<'_, u64, CellSlots<'_>> {
    Consumer::new(s.indices(), CellSlots(&s.slots)).unwrap()
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// Spinning producer and consumer; capacity 2, 3 items: full, empty and
/// wrap-around all happen, and order and content are checked.
#[test]
fn spsc_order_full_empty_wrap() {
    model(|| {
        let s = Shared::new(2);
        let s2 = s.clone();
        let t = thread::spawn(move || {
            let mut p = producer(&s2);
            for v in 1..=3u64 {
                while !p.push(&(v * 10)).unwrap() {
                    thread::yield_now();
                }
                p.publish();
            }
        });
        let mut c = consumer(&s);
        let mut got = Vec::new();
        while got.len() < 3 {
            match c.pop().unwrap() {
                Some(v) => {
                    got.push(v);
                    c.release();
                }
                None => thread::yield_now(),
            }
        }
        assert_eq!(got, vec![10, 20, 30]);
        t.join().unwrap();
    });
}

/// Batched publication and release: the producer fills, publishes once; the
/// consumer drains the batch, releases once.
#[test]
fn batched_publish_and_release() {
    model(|| {
        let s = Shared::new(2);
        let s2 = s.clone();
        let t = thread::spawn(move || {
            let mut p = producer(&s2);
            let mut v = 0;
            while v < 4 {
                while p.push(&v).unwrap() {
                    v += 1;
                    if v == 4 {
                        break;
                    }
                }
                p.publish();
                thread::yield_now();
            }
        });
        let mut c = consumer(&s);
        let mut next = 0;
        while next < 4 {
            while let Some(v) = c.pop().unwrap() {
                assert_eq!(v, next);
                next += 1;
            }
            c.release();
            thread::yield_now();
        }
        t.join().unwrap();
    });
}

/// The consumer sleeps on a doorbell whenever the queue is empty; the
/// producer rings only when `publish` says the consumer sleeps. A lost
/// wakeup would leave the consumer blocked: loom reports the deadlock.
#[test]
fn consumer_sleep_wake_no_lost_wakeup() {
    model(|| {
        let s = Shared::new(2);
        let bell = Arc::new(Bell::default());
        let (s2, bell2) = (s.clone(), bell.clone());
        let t = thread::spawn(move || {
            let mut p = producer(&s2);
            for v in 0..2u64 {
                assert!(p.push(&v).unwrap());
                if p.publish() {
                    bell2.ring();
                }
            }
        });
        let mut c = consumer(&s);
        let mut got = 0;
        while got < 2 {
            if let Some(v) = c.pop().unwrap() {
                assert_eq!(v, got);
                got += 1;
                c.release();
                continue;
            }
            if !c.prepare_sleep().unwrap() {
                bell.wait();
                c.end_sleep();
            }
        }
        t.join().unwrap();
    });
}

/// The producer sleeps when the queue is full; the consumer rings only when
/// `release` says the producer waits.
#[test]
fn producer_wait_space_no_lost_wakeup() {
    model(|| {
        let s = Shared::new(2);
        let bell = Arc::new(Bell::default());
        let (s2, bell2) = (s.clone(), bell.clone());
        let t = thread::spawn(move || {
            let mut c = consumer(&s2);
            let mut got = 0;
            while got < 3 {
                match c.pop().unwrap() {
                    Some(v) => {
                        assert_eq!(v, got);
                        got += 1;
                        if c.release() {
                            bell2.ring();
                        }
                    }
                    None => thread::yield_now(),
                }
            }
        });
        let mut p = producer(&s);
        for v in 0..3u64 {
            while !p.push(&v).unwrap() {
                p.publish();
                if !p.prepare_wait().unwrap() {
                    bell.wait();
                    p.end_wait();
                }
            }
        }
        p.publish();
        t.join().unwrap();
    });
}

/// The same sleep protocol with the re-check after announcing sleep left
/// out (check, then announce, then sleep). This is the classic lost wakeup;
/// the model must find it, which shows the test above would catch one.
#[test]
#[should_panic(expected = "deadlock")]
fn broken_sleep_without_recheck_is_caught() {
    model(|| {
        let s = Shared::new(2);
        let bell = Arc::new(Bell::default());
        let (s2, bell2) = (s.clone(), bell.clone());
        let t = thread::spawn(move || {
            let mut p = producer(&s2);
            assert!(p.push(&1).unwrap());
            if p.publish() {
                bell2.ring();
            }
        });
        let mut c = consumer(&s);
        loop {
            if c.pop().unwrap().is_some() {
                break;
            }
            // BROKEN on purpose: announce sleep without re-checking.
            s.indices()
                .consumer_sleeping
                .store(1, stator_ring::sync::Ordering::SeqCst);
            bell.wait();
            c.end_sleep();
        }
        t.join().unwrap();
    });
}
