//! The control protocol's messages (`daemon/CONTROL.md`): how a task opens a
//! session, registers states and closes it, over a Unix stream socket.
//!
//! Only the byte encoding lives here, shared by the daemon and the
//! clients; sockets and fd passing are theirs. Every frame is
//! `u32 len (LE) | payload[len]`, `len <= MAX_FRAME`; the payload starts
//! with a one-byte message type. Strings are `u16 len (LE) | UTF-8 bytes`.
//! Decoding never panics: a short, long or malformed payload is a
//! [`DecodeError`].

/// Version of this protocol, sent in `Open`; the daemon refuses others.
pub const CONTROL_VERSION: u16 = 1;
/// Largest payload either side accepts.
pub const MAX_FRAME: usize = 64 * 1024;
/// Longest job id, operator id or state name.
pub const MAX_NAME: usize = 1024;
/// Largest max parallelism (Flink's limit).
pub const MAX_PARALLELISM: u32 = 32768;

/// Message types (first payload byte). A response has the request's type
/// with the high bit set.
pub mod msg {
    pub const OPEN: u8 = 1;
    pub const REGISTER: u8 = 2;
    pub const CLOSE: u8 = 3;
    pub const RESTORE: u8 = 4;
    pub const RELEASE: u8 = 5;
    pub const RESPONSE: u8 = 0x80;
}

/// Control status codes (`i32` in every response).
pub mod status {
    pub const OK: i32 = 0;
    /// Malformed or unknown message.
    pub const BAD_REQUEST: i32 = -1;
    /// `Open.version` is not [`super::CONTROL_VERSION`].
    pub const VERSION: i32 = -2;
    /// The peer's uid is not allowed.
    pub const DENIED: i32 = -3;
    /// A configured limit (sessions, states, ring sizes) is reached.
    pub const LIMIT: i32 = -4;
    /// A state of that name exists with another kind.
    pub const CONFLICT: i32 = -5;
    /// The daemon is shutting down.
    pub const SHUTTING_DOWN: i32 = -6;
    /// The request came in the wrong order (e.g. `Register` before `Open`).
    pub const STATE: i32 = -7;
    pub const INTERNAL: i32 = -8;
    /// A restore was refused (unknown, altered or foreign handle, another
    /// job's checkpoint, overlapping checkpoints); nothing changed.
    pub const RESTORE_REFUSED: i32 = -9;
    /// A restore needed the remote tier, which did not answer within its
    /// retries; nothing changed, and the same restore may succeed later.
    pub const REMOTE: i32 = -10;
    /// Unasked, on a session's connection: the client broke the queue
    /// protocol (the message says how); the session's `STATE` word is
    /// `BROKEN`, and the connection closes (the session is dropped).
    pub const QUEUE_BROKEN: i32 = -11;
}

/// State kinds on the wire.
pub mod kind {
    pub const VALUE: u8 = 1;
    pub const LIST: u8 = 2;
    pub const MAP: u8 = 3;
}

/// A request, client -> daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Opens the connection's one session. Ring sizes of 0 take the
    /// daemon's defaults.
    Open {
        version: u16,
        job: String,
        operator: String,
        subtask: u32,
        parallelism: u32,
        max_parallelism: u32,
        sq_entries: u32,
        cq_entries: u32,
        arena_bytes: u64,
        /// 4 MiB chunk slots for portable snapshots (0: the daemon's
        /// default). Optional on the wire; a frame without it asks for 0.
        chunk_slots: u32,
        /// The session's key groups, inclusive, when the engine assigns
        /// them itself (Flink hands each backend its `KeyGroupRange`);
        /// `None` lets the daemon compute Flink's range of `subtask`.
        /// Encoded after `chunk_slots` (so it needs it) as two `u32`s.
        key_groups: Option<(u16, u16)>,
    },
    /// Registers (or finds) a state of this session's operator.
    Register { kind: u8, name: String },
    /// Closes the session; the daemon answers, then closes the socket.
    Close,
    /// Replaces the session's state (its operator's states in its key-group
    /// range) by what the checkpoints `handles` hold of that range. Send it
    /// before submitting requests. At most [`MAX_HANDLES`] handles of at
    /// most [`MAX_HANDLE_LEN`] bytes each.
    Restore { handles: Vec<Vec<u8>> },
    /// The engine no longer references the checkpoints `handles` of
    /// `job`'s `operator` (Flink discarded them): the daemon deletes those
    /// it retains. Needs no session (a JobManager sends it) and claims no
    /// job. At most [`MAX_HANDLES`] handles of at most [`MAX_HANDLE_LEN`]
    /// bytes each.
    Release {
        job: String,
        operator: String,
        handles: Vec<Vec<u8>>,
    },
}

/// Handles one `Restore` may carry.
pub const MAX_HANDLES: usize = 1024;
/// Bytes of one handle in a `Restore`.
pub const MAX_HANDLE_LEN: usize = 256;

/// A response, daemon -> client. `Opened` travels with three fds
/// (SCM_RIGHTS, in this order): the session memfd, the doorbell the
/// client rings to wake the daemon, the doorbell the daemon rings to wake
/// the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    Opened {
        session: u64,
        key_group_lo: u16,
        key_group_hi: u16,
        shard: u32,
    },
    Registered {
        state: u32,
    },
    Closed,
    /// The restore is done: checkpoints used, segment references added.
    Restored {
        checkpoints: u32,
        layers: u32,
    },
    /// The release is done: checkpoints deleted (the others were not, or
    /// no longer, retained here).
    Released {
        released: u32,
    },
    /// A refusal: `status` < 0 and a human-readable reason.
    Error {
        request: u8,
        status: i32,
        message: String,
    },
}

/// Why a payload could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("control message truncated")]
    Short,
    #[error("control message has {0} trailing bytes")]
    Trailing(usize),
    #[error("unknown control message type {0:#x}")]
    Type(u8),
    #[error("a name in a control message is not UTF-8")]
    NotUtf8,
    #[error("a name of {0} bytes in a control message exceeds the {MAX_NAME}-byte limit")]
    NameTooLong(usize),
    #[error("a Restore with {0} handles exceeds the {MAX_HANDLES}-handle limit")]
    TooManyHandles(usize),
    #[error("a Restore handle of {0} bytes exceeds the {MAX_HANDLE_LEN}-byte limit")]
    HandleTooLong(usize),
    #[error("control frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLong(usize),
    #[error("Open's key groups {lo}..={hi} do not fit in 16 bits")]
    BadKeyGroups { lo: u32, hi: u32 },
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Short);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(self.u32()? as i32)
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_NAME {
            return Err(DecodeError::NameTooLong(n));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::NotUtf8)
    }
    /// A handle list (`Restore`, `Release`): `u16` count, then `u16`
    /// length and bytes each.
    fn handles(&mut self) -> Result<Vec<Vec<u8>>, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_HANDLES {
            return Err(DecodeError::TooManyHandles(n));
        }
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let len = self.u16()? as usize;
            if len > MAX_HANDLE_LEN {
                return Err(DecodeError::HandleTooLong(len));
            }
            handles.push(self.take(len)?.to_vec());
        }
        Ok(handles)
    }
    fn end(&self) -> Result<(), DecodeError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

/// Appends a name, refused past [`MAX_NAME`] bytes: a name cut short
/// would be another name (two long job names sharing one job's state).
fn put_name(out: &mut Vec<u8>, s: &str) -> Result<(), DecodeError> {
    if s.len() > MAX_NAME {
        return Err(DecodeError::NameTooLong(s.len()));
    }
    put_str(out, s);
    Ok(())
}

/// Appends a handle list (see `Reader::handles`), refused past
/// [`MAX_HANDLES`] handles or [`MAX_HANDLE_LEN`] bytes in one.
fn put_handles(out: &mut Vec<u8>, handles: &[Vec<u8>]) -> Result<(), DecodeError> {
    if handles.len() > MAX_HANDLES {
        return Err(DecodeError::TooManyHandles(handles.len()));
    }
    out.extend_from_slice(&(handles.len() as u16).to_le_bytes());
    for h in handles {
        if h.len() > MAX_HANDLE_LEN {
            return Err(DecodeError::HandleTooLong(h.len()));
        }
        out.extend_from_slice(&(h.len() as u16).to_le_bytes());
        out.extend_from_slice(h);
    }
    Ok(())
}

/// Appends a message, cut to [`MAX_NAME`] bytes at a character boundary
/// (an error message's tail may go; the frame must stay UTF-8).
fn put_str(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.floor_char_boundary(MAX_NAME)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

/// Starts a frame in `out` (cleared); finish it with [`end_frame`].
fn begin_frame(out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0; 4]);
}

fn end_frame(out: &mut [u8]) {
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
}

impl Request {
    /// The whole frame (length prefix included). What the daemon would
    /// refuse to decode is refused here, with the same error: a name past
    /// [`MAX_NAME`] bytes, more than [`MAX_HANDLES`] handles, a handle past
    /// [`MAX_HANDLE_LEN`] bytes, a frame past [`MAX_FRAME`].
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), DecodeError> {
        begin_frame(out);
        match self {
            Request::Open {
                version,
                job,
                operator,
                subtask,
                parallelism,
                max_parallelism,
                sq_entries,
                cq_entries,
                arena_bytes,
                chunk_slots,
                key_groups,
            } => {
                out.push(msg::OPEN);
                out.extend_from_slice(&version.to_le_bytes());
                for v in [
                    subtask,
                    parallelism,
                    max_parallelism,
                    sq_entries,
                    cq_entries,
                ] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&arena_bytes.to_le_bytes());
                put_name(out, job)?;
                put_name(out, operator)?;
                out.extend_from_slice(&chunk_slots.to_le_bytes());
                if let Some((lo, hi)) = key_groups {
                    out.extend_from_slice(&u32::from(*lo).to_le_bytes());
                    out.extend_from_slice(&u32::from(*hi).to_le_bytes());
                }
            }
            Request::Register { kind, name } => {
                out.push(msg::REGISTER);
                out.push(*kind);
                put_name(out, name)?;
            }
            Request::Close => out.push(msg::CLOSE),
            Request::Restore { handles } => {
                out.push(msg::RESTORE);
                put_handles(out, handles)?;
            }
            Request::Release {
                job,
                operator,
                handles,
            } => {
                out.push(msg::RELEASE);
                put_name(out, job)?;
                put_name(out, operator)?;
                put_handles(out, handles)?;
            }
        }
        if out.len() - 4 > MAX_FRAME {
            return Err(DecodeError::TooLong(out.len() - 4));
        }
        end_frame(out);
        Ok(())
    }

    /// Decodes a payload (without the length prefix).
    pub fn decode(p: &[u8]) -> Result<Request, DecodeError> {
        let mut r = Reader(p);
        let t = r.u8()?;
        let req = match t {
            msg::OPEN => {
                let version = r.u16()?;
                let subtask = r.u32()?;
                let parallelism = r.u32()?;
                let max_parallelism = r.u32()?;
                let sq_entries = r.u32()?;
                let cq_entries = r.u32()?;
                let arena_bytes = r.u64()?;
                let job = r.str()?;
                let operator = r.str()?;
                let chunk_slots = if r.0.is_empty() { 0 } else { r.u32()? };
                let key_groups = if r.0.is_empty() {
                    None
                } else {
                    let (lo, hi) = (r.u32()?, r.u32()?);
                    match (u16::try_from(lo), u16::try_from(hi)) {
                        (Ok(lo), Ok(hi)) => Some((lo, hi)),
                        _ => return Err(DecodeError::BadKeyGroups { lo, hi }),
                    }
                };
                Request::Open {
                    version,
                    job,
                    operator,
                    subtask,
                    parallelism,
                    max_parallelism,
                    sq_entries,
                    cq_entries,
                    arena_bytes,
                    chunk_slots,
                    key_groups,
                }
            }
            msg::REGISTER => {
                let kind = r.u8()?;
                let name = r.str()?;
                Request::Register { kind, name }
            }
            msg::CLOSE => Request::Close,
            msg::RESTORE => Request::Restore {
                handles: r.handles()?,
            },
            msg::RELEASE => {
                let job = r.str()?;
                let operator = r.str()?;
                let handles = r.handles()?;
                Request::Release {
                    job,
                    operator,
                    handles,
                }
            }
            t => return Err(DecodeError::Type(t)),
        };
        r.end()?;
        Ok(req)
    }
}

impl Response {
    /// The whole frame (length prefix included).
    pub fn encode(&self, out: &mut Vec<u8>) {
        begin_frame(out);
        match self {
            Response::Opened {
                session,
                key_group_lo,
                key_group_hi,
                shard,
            } => {
                out.push(msg::OPEN | msg::RESPONSE);
                out.extend_from_slice(&status::OK.to_le_bytes());
                out.extend_from_slice(&session.to_le_bytes());
                out.extend_from_slice(&key_group_lo.to_le_bytes());
                out.extend_from_slice(&key_group_hi.to_le_bytes());
                out.extend_from_slice(&shard.to_le_bytes());
            }
            Response::Registered { state } => {
                out.push(msg::REGISTER | msg::RESPONSE);
                out.extend_from_slice(&status::OK.to_le_bytes());
                out.extend_from_slice(&state.to_le_bytes());
            }
            Response::Closed => {
                out.push(msg::CLOSE | msg::RESPONSE);
                out.extend_from_slice(&status::OK.to_le_bytes());
            }
            Response::Restored {
                checkpoints,
                layers,
            } => {
                out.push(msg::RESTORE | msg::RESPONSE);
                out.extend_from_slice(&status::OK.to_le_bytes());
                out.extend_from_slice(&checkpoints.to_le_bytes());
                out.extend_from_slice(&layers.to_le_bytes());
            }
            Response::Released { released } => {
                out.push(msg::RELEASE | msg::RESPONSE);
                out.extend_from_slice(&status::OK.to_le_bytes());
                out.extend_from_slice(&released.to_le_bytes());
            }
            Response::Error {
                request,
                status,
                message,
            } => {
                out.push(request | msg::RESPONSE);
                out.extend_from_slice(&status.to_le_bytes());
                put_str(out, message);
            }
        }
        end_frame(out);
    }

    /// Decodes a payload (without the length prefix).
    pub fn decode(p: &[u8]) -> Result<Response, DecodeError> {
        let mut r = Reader(p);
        let t = r.u8()?;
        if t & msg::RESPONSE == 0 {
            return Err(DecodeError::Type(t));
        }
        let request = t & !msg::RESPONSE;
        let st = r.i32()?;
        let resp = if st != status::OK {
            Response::Error {
                request,
                status: st,
                message: r.str()?,
            }
        } else {
            match request {
                msg::OPEN => Response::Opened {
                    session: r.u64()?,
                    key_group_lo: r.u16()?,
                    key_group_hi: r.u16()?,
                    shard: r.u32()?,
                },
                msg::REGISTER => Response::Registered { state: r.u32()? },
                msg::CLOSE => Response::Closed,
                msg::RESTORE => Response::Restored {
                    checkpoints: r.u32()?,
                    layers: r.u32()?,
                },
                msg::RELEASE => Response::Released { released: r.u32()? },
                _ => return Err(DecodeError::Type(t)),
            }
        };
        r.end()?;
        Ok(resp)
    }
}

/// Checks a frame's length prefix; returns the payload length to read.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, DecodeError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(DecodeError::TooLong(n));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_responses_round_trip_and_garbage_is_an_error() {
        let reqs = [
            Request::Open {
                version: CONTROL_VERSION,
                job: "job-1".into(),
                operator: "op".into(),
                subtask: 3,
                parallelism: 4,
                max_parallelism: 128,
                sq_entries: 1024,
                cq_entries: 0,
                arena_bytes: 1 << 20,
                chunk_slots: 2,
                key_groups: None,
            },
            Request::Open {
                version: CONTROL_VERSION,
                job: "job-2".into(),
                operator: "op".into(),
                subtask: 0,
                parallelism: 1,
                max_parallelism: 10,
                sq_entries: 0,
                cq_entries: 0,
                arena_bytes: 0,
                chunk_slots: 0,
                key_groups: Some((5, 9)),
            },
            Request::Register {
                kind: kind::MAP,
                name: "counts".into(),
            },
            Request::Close,
            Request::Restore {
                handles: vec![vec![1; 24], vec![], vec![2; 3]],
            },
            Request::Release {
                job: "j".into(),
                operator: "op".into(),
                handles: vec![vec![7; 24]],
            },
        ];
        let mut buf = Vec::new();
        for q in &reqs {
            q.encode(&mut buf).unwrap();
            let n = frame_len(buf[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, buf.len() - 4);
            assert_eq!(&Request::decode(&buf[4..]).unwrap(), q);
            // Every truncation is an error, never a panic, except an Open
            // cut right before one of its optional trailing fields (older
            // clients): chunk_slots 0, no key groups.
            let open_end = match q {
                Request::Open {
                    key_groups: Some(_),
                    ..
                } => buf.len() - 12,
                _ => buf.len() - 4,
            };
            for cut in 4..buf.len() {
                match (q, Request::decode(&buf[4..cut])) {
                    (
                        Request::Open { .. },
                        Ok(Request::Open {
                            chunk_slots,
                            key_groups,
                            ..
                        }),
                    ) if cut == open_end || cut == open_end + 4 => {
                        assert_eq!(key_groups, None);
                        if cut == open_end {
                            assert_eq!(chunk_slots, 0)
                        }
                    }
                    (_, r) => assert!(r.is_err(), "cut at {cut}: {r:?}"),
                }
            }
        }
        let resps = [
            Response::Opened {
                session: 7,
                key_group_lo: 32,
                key_group_hi: 63,
                shard: 1,
            },
            Response::Registered { state: 9 },
            Response::Closed,
            Response::Restored {
                checkpoints: 2,
                layers: 11,
            },
            Response::Released { released: 3 },
            Response::Error {
                request: msg::REGISTER,
                status: status::CONFLICT,
                message: "state x is a map".into(),
            },
        ];
        for r in &resps {
            r.encode(&mut buf);
            assert_eq!(&Response::decode(&buf[4..]).unwrap(), r);
        }
        assert_eq!(Request::decode(&[9]), Err(DecodeError::Type(9)));
        assert_eq!(
            Request::decode(&[msg::CLOSE, 0]),
            Err(DecodeError::Trailing(1))
        );
        assert!(frame_len((MAX_FRAME as u32 + 1).to_le_bytes()).is_err());
    }

    /// Issue 25: a name past the limit is refused, never cut (two long job
    /// names once shared one job's state, and a cut inside a character
    /// broke the frame); so are what the daemon would refuse of a Restore.
    /// A daemon's message past the limit is cut at a character boundary.
    #[test]
    fn what_the_daemon_would_refuse_is_refused_before_it_is_sent() {
        let mut buf = Vec::new();
        // 1,025 bytes; byte 1,024 is inside a character.
        let long = "x".to_string() + &"é".repeat(MAX_NAME / 2);
        let open = |job: &str, operator: &str| Request::Open {
            version: CONTROL_VERSION,
            job: job.into(),
            operator: operator.into(),
            subtask: 0,
            parallelism: 1,
            max_parallelism: 1,
            sq_entries: 0,
            cq_entries: 0,
            arena_bytes: 0,
            chunk_slots: 0,
            key_groups: None,
        };
        let limit = Err(DecodeError::NameTooLong(MAX_NAME + 1));
        assert_eq!(open(&long, "op").encode(&mut buf), limit);
        assert_eq!(open("job", &long).encode(&mut buf), limit);
        let name = long.clone();
        assert_eq!(
            Request::Register {
                kind: kind::VALUE,
                name
            }
            .encode(&mut buf),
            limit
        );
        let at_limit = "a".repeat(MAX_NAME);
        open(&at_limit, &at_limit).encode(&mut buf).unwrap();
        match Request::decode(&buf[4..]).unwrap() {
            Request::Open { job, .. } => assert_eq!(job, at_limit),
            q => panic!("{q:?}"),
        }
        let handles = vec![vec![0; 24]; MAX_HANDLES + 1];
        assert_eq!(
            Request::Restore { handles }.encode(&mut buf),
            Err(DecodeError::TooManyHandles(MAX_HANDLES + 1))
        );
        let handles = vec![vec![0; MAX_HANDLE_LEN + 1]];
        assert_eq!(
            Request::Restore { handles }.encode(&mut buf),
            Err(DecodeError::HandleTooLong(MAX_HANDLE_LEN + 1))
        );
        let handles = vec![vec![0; MAX_HANDLE_LEN]; MAX_HANDLES];
        assert!(matches!(
            Request::Restore { handles }.encode(&mut buf),
            Err(DecodeError::TooLong(_))
        ));
        let r = Response::Error {
            request: msg::OPEN,
            status: status::LIMIT,
            message: long.clone(),
        };
        r.encode(&mut buf);
        match Response::decode(&buf[4..]).unwrap() {
            Response::Error { message, .. } => assert_eq!(message, long[..MAX_NAME - 1]),
            r => panic!("{r:?}"),
        }
    }
}
