//! Control-socket messages (`ring/PROTOCOL.md` §control): the frame length
//! prefix, and every request and response the daemon or a client decodes.
//! A message that decodes must survive an encode and decode unchanged (not
//! byte for byte: an `Open` from a client older than chunk slots omits
//! the field and reads as 0).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stator_ring::control::{Request, Response, frame_len};

fuzz_target!(|data: &[u8]| {
    if let Some(prefix) = data.get(..4) {
        let _ = frame_len(prefix.try_into().expect("4 bytes"));
    }
    let mut out = Vec::new();
    if let Ok(req) = Request::decode(data) {
        // (A decoded payload may be longer than a frame may be.)
        if req.encode(&mut out).is_ok() {
            assert_eq!(Request::decode(&out[4..]).as_ref(), Ok(&req));
        }
    }
    if let Ok(resp) = Response::decode(data) {
        resp.encode(&mut out);
        assert_eq!(Response::decode(&out[4..]).as_ref(), Ok(&resp));
    }
});
