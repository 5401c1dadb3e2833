//! Helpers shared by the store's integration tests.
#![allow(dead_code)]

pub mod s3;

use std::time::Duration;

use stator_store::io::Io;
use stator_store::snapshot::StateDesc;
use stator_store::{
    CheckpointSpec, ExportSpec, Fill, ImportSpec, ImportStep, Imported, Op, Output, Store,
    StoreError, Submitted,
};

/// An output copied out of the store.
#[derive(Debug, PartialEq, Eq, Clone)]
pub enum Owned {
    Done,
    Value(Option<Vec<u8>>),
    Contains(bool),
    Page(Vec<u8>, u32, Vec<u8>, bool),
    Imported(Imported),
}

impl From<Output<'_>> for Owned {
    fn from(o: Output<'_>) -> Owned {
        match o {
            Output::Done => Owned::Done,
            Output::Value(v) => Owned::Value(v.map(|v| v.to_vec())),
            Output::Contains(b) => Owned::Contains(b),
            Output::Page {
                data,
                entries,
                last_key,
                more,
            } => Owned::Page(data.to_vec(), entries, last_key.to_vec(), more),
            Output::Imported(i) => Owned::Imported(i),
        }
    }
}

/// Runs one op to completion.
pub fn run<I: Io>(s: &mut Store<I>, op: Op<'_>) -> Result<Owned, StoreError> {
    match s.submit(u64::MAX, op)? {
        Submitted::Ready(o) => Ok(Owned::from(o)),
        Submitted::Pending => {
            let mut got = None;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while got.is_none() {
                s.poll(|_, r| got = Some(r.map(Owned::from)));
                if got.is_none() {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "a read never completed"
                    );
                    s.wait(Some(Duration::from_millis(5))).unwrap();
                }
            }
            got.unwrap()
        }
    }
}

/// Runs background work until nothing is left (retrying failed jobs).
pub fn settle_fully<I: Io>(s: &mut Store<I>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while s.busy() {
        s.settle();
        assert!(
            std::time::Instant::now() < deadline,
            "background work never finished: {:?}",
            s.stats()
        );
        if s.busy() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Takes a checkpoint and waits for its handle.
pub fn checkpoint<I: Io>(s: &mut Store<I>, spec: CheckpointSpec) -> Result<Vec<u8>, StoreError> {
    const TOKEN: u64 = 0xc0ffee;
    s.checkpoint(TOKEN, spec)?;
    wait_token(s, TOKEN).map(|o| match o {
        Owned::Value(Some(h)) => h,
        o => panic!("a checkpoint completed with {o:?}"),
    })
}

/// Notifies checkpoint `id` of `owner` and waits for the acknowledgement
/// (a completion's marker durable); returns how many manifests it deleted.
pub fn notify<I: Io>(
    s: &mut Store<I>,
    owner: &[u8],
    id: u64,
    kind: stator_store::Notify,
) -> Result<usize, StoreError> {
    const TOKEN: u64 = 0x0b5e55ed;
    let n = s.checkpoint_notify_acked(owner, id, kind, TOKEN);
    wait_token(s, TOKEN).map(|_| n)
}

/// Polls until `token` completes (within 60 s).
pub fn wait_token<I: Io>(s: &mut Store<I>, token: u64) -> Result<Owned, StoreError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut got = None;
    while got.is_none() {
        s.poll(|t, r| {
            if t == token {
                got = Some(r.map(Owned::from));
            }
        });
        assert!(
            std::time::Instant::now() < deadline,
            "operation {token:#x} never completed"
        );
        if got.is_none() {
            s.wait(Some(Duration::from_millis(5))).unwrap();
        }
    }
    got.unwrap()
}

/// Copies the files of `from` into `to` (a fixture, to open a copy).
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Exports into slots of `slot_len` bytes; the chunks.
pub fn export_chunks<I: Io>(
    s: &mut Store<I>,
    spec: ExportSpec,
    slot_len: usize,
) -> Result<Vec<Vec<u8>>, StoreError> {
    let id = s.export(spec)?;
    fill_chunks(s, id, slot_len)
}

/// Fills export `id` into chunks of `slot_len` until its last.
pub fn fill_chunks<I: Io>(
    s: &mut Store<I>,
    id: usize,
    slot_len: usize,
) -> Result<Vec<Vec<u8>>, StoreError> {
    let mut slot = vec![0u8; slot_len];
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match s.export_fill(id, &mut slot[..])? {
            Fill::Chunk { len, last } => {
                out.push(slot[..len].to_vec());
                if last {
                    return Ok(out);
                }
            }
            Fill::Again => {}
            Fill::Wait => {
                assert!(std::time::Instant::now() < deadline, "export stalled");
                s.poll(|_, _| {});
                if !s.background_runnable() {
                    s.wait(Some(Duration::from_millis(5))).unwrap();
                }
            }
        }
    }
}

/// Imports `chunks`, resolving state names through `names` (name -> id).
pub fn import_chunks<I: Io>(
    s: &mut Store<I>,
    spec: ImportSpec,
    chunks: &[Vec<u8>],
    names: &[(&[u8], u32)],
) -> Result<Imported, StoreError> {
    const TOKEN: u64 = 0x1417;
    let id = s.import_begin(spec)?;
    let mut resolve = |table: &[StateDesc]| {
        table
            .iter()
            .map(|d| {
                names
                    .iter()
                    .find(|(n, _)| *n == &d.name[..])
                    .map(|(_, id)| *id)
                    .ok_or_else(|| format!("no state {}", String::from_utf8_lossy(&d.name)))
            })
            .collect::<Result<Vec<u32>, String>>()
    };
    let mut finishing = false;
    for c in chunks {
        finishing = s.import_chunk(id, c, TOKEN, &mut resolve)? == ImportStep::Finishing;
    }
    if !finishing {
        s.import_cancel(id);
        return Err(StoreError::Snapshot(
            "the chunks ended before the last one".into(),
        ));
    }
    wait_token(s, TOKEN).map(|o| match o {
        Owned::Imported(i) => i,
        o => panic!("an import completed with {o:?}"),
    })
}
