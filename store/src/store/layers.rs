//! The layer list, `LAYERS` (FORMAT.md §10): the masks (key-group
//! deletes, restored regions) and the segments restores reference.
//!
//! A change is applied in memory at once and made durable here in the
//! background, through the store's I/O layer, so that no shard waits for
//! it: the temporary file is removed (a crash's leftover) and created,
//! written and fsynced, renamed over `LAYERS`, and the directory fsynced.
//! Changes made meanwhile are written by the next round. Until the list is
//! durable, no flush starts (a newer layer durable beside an older list
//! would let a crash bring back what a mask hid under newer writes), and
//! layers a mask retired are not deleted (the durable list may still name
//! them). A compaction is not held back (with slow fsyncs, the simulator's
//! restore-heavy runs fell hundreds of layers behind when it was): one
//! that merges a restored layer or applies a mask in that window leaves,
//! after a crash before the list is durable, the restored or deleted range
//! partly as before and partly as after. Durability is the checkpoint's:
//! after a crash the engine restores the range from its last checkpoint,
//! which masks all of it. A failure is reported as a background error and
//! retried after the retry delay.
//!
//! Opening a store reads the list, and rewrites it synchronously when it
//! must (imports a compaction merged, a version-1 `KGDELETES`), before
//! any session is served.

use super::*;

/// Version 1's list of key-group deletes, read once and replaced by
/// [`LAYERS_FILE`] (FORMAT.md §10).
const KGDEL_FILE: &str = "KGDELETES";
/// Where the next list is written before it is renamed over `LAYERS`.
const LAYERS_TMP: &str = "LAYERS.tmp";
/// Masks (key-group deletes, restored regions) and the segments restores
/// reference (FORMAT.md §10).
pub(super) const LAYERS_FILE: &str = "LAYERS";
const LAYERS_MAGIC: [u8; 8] = *b"STLAYERS";
/// Written: 2, padded to 4096 (an older binary refuses it as a version it
/// does not know rather than as a length mismatch). Read: 1 and 2, the
/// same layout (version 1 files are never padded).
const LAYERS_VERSION: u16 = 2;

/// A segment a restore references, as `LAYERS` records it.
pub(super) struct ImportRec {
    pub name: String,
    pub order: u64,
    pub generation: u32,
    pub clip: Clip,
}

/// Masks, imports, and whether the file must be rewritten (it was the
/// version-1 `KGDELETES`).
pub(super) fn load_layers(dir: &Path) -> Result<(Vec<KgDelete>, Vec<ImportRec>, bool), StoreError> {
    let path = dir.join(LAYERS_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let old = load_kg_deletes(dir)?;
            let legacy = !old.is_empty();
            return Ok((old, Vec::new(), legacy));
        }
        Err(e) => return Err(StoreError::io(&path, "read", &e)),
    };
    let bad = |what| StoreError::Corrupt {
        path: path.display().to_string(),
        offset: 0,
        what,
    };
    if bytes.len() < 20 || bytes[..8] != LAYERS_MAGIC {
        return Err(bad("layer list has a bad magic"));
    }
    if !(1..=LAYERS_VERSION).contains(&u16::from_le_bytes([bytes[8], bytes[9]])) {
        return Err(bad(format::UNSUPPORTED_VERSION));
    }
    let body_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4")) as usize;
    // Zeros may pad it to a multiple of 4096 (written with O_DIRECT).
    if body_len < 16 || body_len + 4 > bytes.len() || bytes[body_len + 4..].iter().any(|&b| b != 0)
    {
        return Err(bad("layer list length mismatch"));
    }
    if crc32c::crc32c(&bytes[..body_len])
        != u32::from_le_bytes(bytes[body_len..body_len + 4].try_into().expect("4"))
    {
        return Err(bad("layer list checksum mismatch"));
    }
    let parse = || -> Result<(Vec<KgDelete>, Vec<ImportRec>), crate::manifest::Malformed> {
        let mut r = crate::manifest::R(&bytes[16..body_len]);
        let n = r.u32()?;
        let mut masks = Vec::new();
        for _ in 0..n {
            let max_order = r.u64()?;
            let region = crate::manifest::decode_region(&mut r)?;
            masks.push(KgDelete { region, max_order });
        }
        let n = r.u32()?;
        let mut imports = Vec::new();
        for _ in 0..n {
            let nl = r.u16()? as usize;
            let name: Vec<u8> = (0..nl).map(|_| r.u8()).collect::<Result<_, _>>()?;
            let name = String::from_utf8(name)
                .ok()
                .filter(|n| segment::is_layer_file_name(n))
                .ok_or(crate::manifest::Malformed("import names no segment file"))?;
            let order = r.u64()?;
            let generation = r.u32()?;
            let clip = crate::manifest::decode_clip(&mut r)?;
            imports.push(ImportRec {
                name,
                order,
                generation,
                clip,
            });
        }
        if !r.0.is_empty() {
            return Err(crate::manifest::Malformed("bytes after the last import"));
        }
        Ok((masks, imports))
    };
    let (masks, imports) = parse().map_err(|m| bad(m.0))?;
    Ok((masks, imports, false))
}

/// The list of the masks and the restored layers among `layers`, padded
/// with zeros to a multiple of 4096 (FORMAT.md §10).
fn encode_layers(masks: &[KgDelete], layers: &[Rc<Segment>]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&LAYERS_MAGIC);
    body.extend_from_slice(&LAYERS_VERSION.to_le_bytes());
    body.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    body.extend_from_slice(&(masks.len() as u32).to_le_bytes());
    for d in masks {
        body.extend_from_slice(&d.max_order.to_le_bytes());
        crate::manifest::encode_region(&mut body, &d.region);
    }
    let imports: Vec<&Rc<Segment>> = layers.iter().filter(|s| s.clip.is_some()).collect();
    body.extend_from_slice(&(imports.len() as u32).to_le_bytes());
    for s in imports {
        let name = s.name();
        body.extend_from_slice(&(name.len() as u16).to_le_bytes());
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(&s.footer.order.to_le_bytes());
        body.extend_from_slice(&s.footer.generation.to_le_bytes());
        crate::manifest::encode_clip(&mut body, s.clip.as_ref().expect("filtered"));
    }
    let body_len = body.len() as u32;
    body[12..16].copy_from_slice(&body_len.to_le_bytes());
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body.resize(body.len().next_multiple_of(ALIGN), 0);
    body
}

/// Persists the list synchronously: written to the temporary file,
/// synced, renamed over the old list, and the version-1 file removed
/// (at open only, before any session is served).
pub(super) fn save_layers(
    dir: &Path,
    masks: &[KgDelete],
    layers: &[Rc<Segment>],
) -> Result<(), StoreError> {
    use std::io::Write;
    let path = dir.join(LAYERS_FILE);
    let tmp = dir.join(LAYERS_TMP);
    let body = encode_layers(masks, layers);
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        match std::fs::remove_file(dir.join(KGDEL_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::File::open(dir)?.sync_all()
    })();
    r.map_err(|e| StoreError::io(&path, "write", &e))
}

/// The layer list's way to the disk (see the module doc).
#[derive(Default)]
pub(super) struct Layers {
    /// The list changed since the last write began.
    dirty: bool,
    /// The write in progress.
    io: Option<LayersIo>,
    serial: u64,
    /// Layers masks hid, kept until a list that no longer names them is
    /// durable (then retired: deleted once unreferenced), and how many of
    /// them the write in progress covers.
    hidden: Vec<Rc<Segment>>,
    covered: usize,
}

/// A write of the list, one step at a time.
struct LayersIo {
    serial: u64,
    step: LayersStep,
    /// The list's bytes, until written.
    bytes: Option<AlignedBuf>,
    /// The temporary file, open while it is written and fsynced.
    file: Option<crate::io::FileId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayersStep {
    /// The temporary file a crash may have left is removed.
    Unlink,
    Write,
    Sync,
    Rename,
    DirSync,
}

impl Layers {
    /// Whether the list in memory is not durable yet.
    pub(super) fn pending(&self) -> bool {
        self.dirty || self.io.is_some()
    }

    /// Whether a write can start now.
    pub(super) fn startable(&self) -> bool {
        self.dirty && self.io.is_none()
    }

    /// Layers a mask hid, which the durable list may still name.
    pub(super) fn hidden(&self) -> &[Rc<Segment>] {
        &self.hidden
    }

    /// The list changed; `hidden` left it.
    pub(super) fn changed(&mut self, hidden: Vec<Rc<Segment>>) {
        self.dirty = true;
        self.hidden.extend(hidden);
    }
}

impl<I: Io> Store<I> {
    /// Starts writing the list if it changed and no write runs.
    pub(super) fn step_layers(&mut self) {
        if !self.layers.startable() {
            return;
        }
        let l = &mut self.layers;
        l.dirty = false;
        l.covered = l.hidden.len();
        l.serial = (l.serial + 1) & SERIAL_MASK;
        let bytes = encode_layers(&self.kg_deletes, &self.segments);
        l.io = Some(LayersIo {
            serial: l.serial,
            step: LayersStep::Unlink,
            bytes: Some(AlignedBuf::copy_of(&bytes)),
            file: None,
        });
        let token = tag(Tag::Layers, l.serial);
        self.io.unlink(&self.cfg.dir.join(LAYERS_TMP), token);
    }

    /// Advances the write `serial` by its step's outcome `r`.
    pub(super) fn layers_io_done(&mut self, serial: u64, r: Result<usize, i32>) {
        let Some(mut w) = self.layers.io.take_if(|w| w.serial == serial) else {
            return;
        };
        let dir = self.cfg.dir.clone();
        let tmp = dir.join(LAYERS_TMP);
        let token = tag(Tag::Layers, serial);
        let failed = |op: &'static str, errno: i32| StoreError::from_errno(&tmp, op, errno);
        let next = match (w.step, r) {
            (LayersStep::Unlink, Ok(_) | Err(libc::ENOENT)) => {
                match self.io.open(&tmp, OpenMode::CreateNew) {
                    Ok(f) => {
                        w.file = Some(f);
                        let buf = w.bytes.take().expect("written once");
                        self.io.write(f, 0, buf, token);
                        Ok(LayersStep::Write)
                    }
                    Err(e) => Err(StoreError::io(&tmp, "create", &e)),
                }
            }
            (LayersStep::Write, Ok(_)) => {
                self.io.fsync(w.file.expect("open while written"), token);
                Ok(LayersStep::Sync)
            }
            (LayersStep::Sync, Ok(_)) => {
                self.io.close(w.file.take().expect("open while synced"));
                self.io.rename(&tmp, &dir.join(LAYERS_FILE), token);
                Ok(LayersStep::Rename)
            }
            (LayersStep::Rename, Ok(_)) => self.dir_fd().map(|d| {
                self.io.fsync(d, token);
                LayersStep::DirSync
            }),
            (LayersStep::DirSync, Ok(_)) => {
                // Durable: the layers it no longer names may go.
                let l = &mut self.layers;
                let covered = l.covered.min(l.hidden.len());
                self.retired.extend(l.hidden.drain(..covered));
                l.covered = 0;
                return;
            }
            (LayersStep::Unlink, Err(e)) => Err(failed("unlink", e)),
            (LayersStep::Write, Err(e)) => Err(failed("write", e)),
            (LayersStep::Sync, Err(e)) => Err(failed("fsync", e)),
            (LayersStep::Rename, Err(e)) => Err(failed("rename", e)),
            (LayersStep::DirSync, Err(e)) => Err(failed("fsync directory", e)),
        };
        match next {
            Ok(step) => {
                w.step = step;
                self.layers.io = Some(w);
            }
            Err(e) => {
                // Written again, whole, after the retry delay.
                if let Some(f) = w.file {
                    self.io.close(f);
                }
                self.layers.dirty = true;
                self.layers.covered = 0;
                self.background_failed(e);
            }
        }
    }
}

fn load_kg_deletes(dir: &Path) -> Result<Vec<KgDelete>, StoreError> {
    let path = dir.join(KGDEL_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(&path, "read", &e)),
    };
    let bad = |what| StoreError::Corrupt {
        path: path.display().to_string(),
        offset: 0,
        what,
    };
    if bytes.len() < 8 || !(bytes.len() - 8).is_multiple_of(12) {
        return Err(bad("key-group delete list has a bad length"));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4")) {
        return Err(bad("key-group delete list checksum mismatch"));
    }
    let count = u32::from_le_bytes(body[..4].try_into().expect("4")) as usize;
    if count * 12 != body.len() - 4 {
        return Err(bad("key-group delete list count does not match its length"));
    }
    Ok(body[4..]
        .chunks_exact(12)
        .map(|c| KgDelete {
            region: Region {
                lo: u16::from_le_bytes([c[0], c[1]]),
                hi: u16::from_le_bytes([c[2], c[3]]),
                states: None,
            },
            max_order: u64::from_le_bytes(c[4..12].try_into().expect("8")),
        })
        .collect())
}
