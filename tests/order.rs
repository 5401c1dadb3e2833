//! Per-key order with 65,536 requests in flight on one session: a random
//! mix of every operation, all submitted before any completion is read,
//! checked against a model applied in submission order.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::{Daemon, Done, Rng, collect, opts};
use stator_client::{
    IterMode, Kind, ListState, MapState, Page, Session, Status, ValueState, elements,
};

#[derive(Default)]
struct Model {
    values: HashMap<u64, Vec<u8>>,
    lists: HashMap<u64, Vec<Vec<u8>>>,
    maps: HashMap<u64, BTreeMap<Vec<u8>, Vec<u8>>>,
}

fn ok(v: Option<Vec<u8>>) -> Done {
    match v {
        Some(v) => Done {
            status: Ok(Status::Ok),
            value: Some(v),
            aux: 0,
            more: false,
        },
        None => Done {
            status: Ok(Status::NotFound),
            value: None,
            aux: 0,
            more: false,
        },
    }
}

fn done() -> Done {
    ok(Some(Vec::new())).with_value(None)
}

trait With {
    fn with_value(self, v: Option<Vec<u8>>) -> Self;
    fn with_aux(self, a: u64) -> Self;
}
impl With for Done {
    fn with_value(mut self, v: Option<Vec<u8>>) -> Self {
        self.value = v;
        self
    }
    fn with_aux(mut self, a: u64) -> Self {
        self.aux = a;
        self
    }
}

const IN_FLIGHT: usize = 65_536;
const KEYS: u64 = 512;

#[test]
fn per_key_order_holds_with_65536_requests_in_flight() {
    // A small budget: memtables flush while the requests run, so reads
    // are answered from memory and from segments on disk.
    let d = Daemon::start(16);
    let mut o = opts("order-job", 0, 1);
    o.sq_entries = IN_FLIGHT as u32;
    o.cq_entries = IN_FLIGHT as u32;
    o.arena_bytes = 256 << 20;
    let mut s = Session::open(&d.socket, &o).expect("open");
    let vs = ValueState(s.register("v", Kind::Value).unwrap());
    let ls = ListState(s.register("l", Kind::List).unwrap());
    let ms = MapState(s.register("m", Kind::Map).unwrap());

    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut model = Model::default();
    for round in 0..3 {
        let mut expect: Vec<Done> = Vec::with_capacity(IN_FLIGHT);
        let mut pages: Vec<bool> = Vec::with_capacity(IN_FLIGHT);
        for t in 0..IN_FLIGHT as u64 {
            let k = rng.below(KEYS);
            let key = k.to_be_bytes();
            let kg = (k % 128) as u16;
            let uk = [rng.below(8) as u8];
            let (req_kind, want) = match rng.below(13) {
                0 | 1 => {
                    let v = rng.bytes(200);
                    model.values.insert(k, v.clone());
                    (Some(("put", v)), done())
                }
                2 | 3 => (None, ok(model.values.get(&k).cloned())),
                4 => {
                    model.values.remove(&k);
                    (Some(("delete", vec![])), done())
                }
                5 => {
                    let e = rng.bytes(24);
                    model.lists.entry(k).or_default().push(e.clone());
                    (Some(("append", e)), done())
                }
                6 => {
                    let l = model.lists.get(&k).filter(|l| !l.is_empty());
                    let v = l.map(|l| stator_client::encode_elements(l.iter().map(|e| &e[..])));
                    (Some(("listget", vec![])), ok(v))
                }
                7 => {
                    let v = rng.bytes(40);
                    model
                        .maps
                        .entry(k)
                        .or_default()
                        .insert(uk.to_vec(), v.clone());
                    (Some(("mapput", v)), done())
                }
                8 => {
                    let v = model.maps.get(&k).and_then(|m| m.get(&uk[..]).cloned());
                    (Some(("mapget", vec![])), ok(v))
                }
                9 => {
                    if let Some(m) = model.maps.get_mut(&k) {
                        m.remove(&uk[..]);
                    }
                    (Some(("mapremove", vec![])), done())
                }
                10 => {
                    let has = model.maps.get(&k).is_some_and(|m| m.contains_key(&uk[..]));
                    (Some(("contains", vec![])), done().with_aux(has as u64))
                }
                11 => {
                    let m = model.maps.get(&k).cloned().unwrap_or_default();
                    let mut data = Vec::new();
                    for (u, v) in &m {
                        data.extend_from_slice(&(u.len() as u32).to_le_bytes());
                        data.extend_from_slice(u);
                        data.extend_from_slice(&(v.len() as u32).to_le_bytes());
                        data.extend_from_slice(v);
                    }
                    (Some(("iter", data)), done().with_aux(m.len() as u64))
                }
                _ => {
                    if rng.below(2) == 0 {
                        model.maps.remove(&k);
                        (Some(("clearmap", vec![])), done())
                    } else {
                        model.lists.remove(&k);
                        (Some(("clearlist", vec![])), done())
                    }
                }
            };
            let r = match &req_kind {
                None => vs.get(kg, &key),
                Some((name, v)) => match *name {
                    "put" => vs.put(kg, &key, v),
                    "delete" => vs.delete(kg, &key),
                    "append" => ls.append(kg, &key, v),
                    "listget" => {
                        let mut r = ls.get(kg, &key);
                        r.capacity = 16 << 10;
                        r
                    }
                    "mapput" => ms.put(kg, &key, &uk, v),
                    "mapget" => ms.get(kg, &key, &uk),
                    "mapremove" => ms.remove(kg, &key, &uk),
                    "contains" => ms.contains(kg, &key, &uk),
                    "iter" => {
                        let mut r = ms.iter(kg, &key, IterMode::Entries, None);
                        r.capacity = 4096;
                        r
                    }
                    "clearmap" => ms.clear(kg, &key),
                    _ => ls.clear(kg, &key),
                },
            };
            s.submit(&r, t)
                .unwrap_or_else(|e| panic!("submit {t}: {e}"));
            let want = if let Some(("iter", data)) = &req_kind {
                // Compared on the page's data (the cursor follows it).
                want.with_value(Some(data.clone()))
            } else {
                want
            };
            pages.push(matches!(&req_kind, Some(("iter", _))));
            expect.push(want);
        }
        assert_eq!(
            s.in_flight(),
            IN_FLIGHT,
            "all requests are in flight at once"
        );
        s.flush().unwrap();
        let mut seen = 0;
        collect(&mut s, IN_FLIGHT, |t, mut got| {
            let want = &expect[t as usize];
            if pages[t as usize] {
                // A map page: `data | cursor | u32 len`; compare the data.
                let v = got.value.take().expect("a page has bytes");
                let p = Page::parse(&v).expect("a well-formed page");
                got.value = Some(p.data.to_vec());
                assert!(!got.more, "a 4 KiB page holds a whole map of 8 entries");
            }
            assert_eq!(&got, want, "round {round}, request {t}");
            seen += 1;
        })
        .expect("collect");
        assert_eq!(seen, IN_FLIGHT);
    }
    // Lists decode as the elements appended.
    for (k, l) in model.lists.iter().take(5) {
        let key = k.to_be_bytes();
        let mut r = ls.get((k % 128) as u16, &key);
        r.capacity = 16 << 10;
        let got = common::run(&mut s, &r).unwrap();
        if l.is_empty() {
            continue;
        }
        let v = got.value.expect("list");
        assert_eq!(
            elements(&v).unwrap(),
            l.iter().map(|e| &e[..]).collect::<Vec<_>>()
        );
    }
}
