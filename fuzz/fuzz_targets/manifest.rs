//! Checkpoint manifests and handles (`store/FORMAT.md` §10, §11), as read
//! from a store directory, the remote tier or a client's restore request.
//! A manifest that decodes must survive an encode and decode unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stator_fuzz::{set_crc, u32_at};
use stator_store::manifest::{Handle, Manifest};

fn check(b: &[u8]) {
    if let Ok((m, _)) = Manifest::decode(b) {
        let again = m.encode();
        let (m2, _) = Manifest::decode(&again).expect("a decoded manifest re-encodes");
        assert_eq!(m, m2);
    }
    if let Ok(h) = Handle::decode(b) {
        assert_eq!(&h.encode()[..], b);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    // The same bytes with their checksums made right: the body length
    // (u32 at 12) says where the manifest CRC goes; a handle's is at 20.
    let mut b = data.to_vec();
    let body = u32_at(&b, 12) as usize;
    set_crc(&mut b, 0..body, body);
    check(&b);
    let mut h = data.to_vec();
    set_crc(&mut h, 0..20, 20);
    check(&h);
});
