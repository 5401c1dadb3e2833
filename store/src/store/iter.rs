//! Map iteration: one page of a map merged over every layer.

use super::*;

impl<I: Io> Store<I> {
    pub(super) fn submit_iter(
        &mut self,
        token: u64,
        map: KeyRef<'_>,
        mode: IterMode,
        after: Option<&[u8]>,
        max_bytes: usize,
    ) -> Result<Submitted<'_>, StoreError> {
        let base = encode(&map, None)?;
        let mut start = base.clone();
        if let Some(a) = after {
            start.extend_from_slice(a);
        }
        let mut mem: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut mem_capped_at: Option<Vec<u8>> = None;
        let mut mem_cleared = false;
        let hb = bloom::hash(&base);
        let layers = std::iter::once((u64::MAX, &self.active))
            .chain(self.frozen.iter().map(|(o, m)| (*o, &**m)));
        for (order, m) in layers {
            if order != u64::MAX && self.masked_order(order, &base) {
                // A mask removed this and every older memtable; segments a
                // restore added since are newer and still count (run_iter
                // stops at the first masked one).
                break;
            }
            for (n, k) in m.map_range(&base, Some(&start)).enumerate() {
                if n == ITER_LAYER_CAP {
                    let cap = k.to_vec();
                    if mem_capped_at.as_ref().is_none_or(|c| cap < *c) {
                        mem_capped_at = Some(cap);
                    }
                    break;
                }
                let rec = m.lookup(k, bloom::hash(k)).expect("map keys are indexed");
                let v = (rec.kind == Kind::Put).then(|| rec.value.to_vec());
                mem.entry(k.to_vec()).or_insert(v);
            }
            if m.lookup(&base, hb).is_some_and(|r| r.kind == Kind::Clear) {
                mem_cleared = true;
                break;
            }
        }
        let layers = if mem_cleared {
            Vec::new()
        } else {
            self.segments.clone()
        };
        let id = self.iters.insert(PendingIter {
            token,
            base,
            start,
            mode,
            max_bytes,
            mem,
            mem_capped_at,
            layers,
            pinned: HashMap::new(),
        });
        self.run_iter(id);
        match self.done.back() {
            Some((t, _)) if *t == token && !self.iters.contains(id) => {
                let (_, r) = self.done.pop_back().expect("checked non-empty");
                Ok(Submitted::Ready(self.hold(r?)))
            }
            _ => Ok(Submitted::Pending),
        }
    }

    /// Runs an iteration as far as pinned and cached blocks allow; either
    /// finishes it (pushing to `done`) or issues the next fetch.
    pub(super) fn run_iter(&mut self, id: usize) {
        let it = &self.iters[id];
        // Segments newest first: collect each layer's entries in range.
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = it.mem.clone();
        let mut cap: Option<Vec<u8>> = it.mem_capped_at.clone();
        let mut need: Option<(Rc<Segment>, u32)> = None;
        'layers: for seg in &it.layers {
            if seg.clipped(&it.base) {
                // Not this layer's part of the key space; older ones may hold it.
                continue;
            }
            if self.masked_order(seg.footer.order, &it.base) {
                break;
            }
            let mut layer: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
            let mut cleared = false;
            // The clear marker, at the base key.
            if seg.may_contain(&it.base, bloom::hash(&it.base))
                && let Some(bi) = seg.index.find(&it.base)
            {
                match self.block_for(&it.pinned, seg, bi) {
                    None => {
                        need = Some((seg.clone(), bi as u32));
                        break 'layers;
                    }
                    Some(b) => {
                        if b.view()
                            .find(&it.base)
                            .is_some_and(|r| r.kind == Kind::Clear)
                        {
                            cleared = true;
                        }
                    }
                }
            }
            if let Some(mut bi) = seg.index.find(&it.start) {
                'blocks: loop {
                    let Some(b) = self.block_for(&it.pinned, seg, bi) else {
                        need = Some((seg.clone(), bi as u32));
                        break 'layers;
                    };
                    let v = b.view();
                    let mut i = v.lower_bound(&it.start);
                    while i < v.len() {
                        let r = v.record(i);
                        i += 1;
                        if r.key <= &it.start[..] {
                            continue;
                        }
                        if !r.key.starts_with(&it.base) {
                            break 'blocks;
                        }
                        if layer.len() == ITER_LAYER_CAP {
                            if cap.as_ref().is_none_or(|c| r.key < &c[..]) {
                                cap = Some(r.key.to_vec());
                            }
                            break 'blocks;
                        }
                        layer.push((
                            r.key.to_vec(),
                            (r.kind == Kind::Put).then(|| r.value.to_vec()),
                        ));
                    }
                    bi += 1;
                    if bi >= seg.index.len() {
                        break;
                    }
                }
            }
            for (k, v) in layer {
                merged.entry(k).or_insert(v);
            }
            if cleared {
                break;
            }
        }
        if let Some((seg, b)) = need {
            self.fetch(seg, b, None, Some(id));
            return;
        }
        let it = self.iters.remove(id);
        let mut data = Vec::new();
        let mut entries = 0u32;
        // The resume cursor: the last user key this page examined (returned
        // or deleted), so a page of only deleted entries still advances.
        let mut last_key = Vec::new();
        // A layer stopped collecting at `cap`: entries from there on are
        // unknown until the next page.
        let mut more = cap.is_some();
        for (k, v) in merged {
            if cap.as_ref().is_some_and(|c| k >= *c) {
                break;
            }
            let ukey = &k[it.base.len()..];
            let Some(v) = v else {
                last_key.clear();
                last_key.extend_from_slice(ukey);
                continue;
            };
            let add = match it.mode {
                IterMode::Keys => 4 + ukey.len(),
                IterMode::Values => 4 + v.len(),
                IterMode::Entries => 8 + ukey.len() + v.len(),
            };
            if data.len() + add > it.max_bytes {
                if entries == 0 {
                    // Not even one entry fits: say how much it needs rather
                    // than return an empty page that cannot advance.
                    let e = StoreError::TooLarge {
                        what: "the next map entry of this page",
                        len: add,
                        max: it.max_bytes,
                    };
                    self.done.push_back((it.token, Err(e)));
                    return;
                }
                more = true;
                break;
            }
            if matches!(it.mode, IterMode::Keys | IterMode::Entries) {
                encode_element(&mut data, ukey);
            }
            if matches!(it.mode, IterMode::Values | IterMode::Entries) {
                encode_element(&mut data, &v);
            }
            entries += 1;
            last_key.clear();
            last_key.extend_from_slice(ukey);
        }
        self.done.push_back((
            it.token,
            Ok(Resolved::Page {
                data,
                entries,
                last_key,
                more,
            }),
        ));
    }

    pub(super) fn block_for(
        &self,
        pinned: &HashMap<(u64, u32), Rc<Block>>,
        seg: &Segment,
        bi: usize,
    ) -> Option<Rc<Block>> {
        pinned
            .get(&(seg.id, bi as u32))
            .cloned()
            .or_else(|| self.cache.peek(seg.id, bi as u32))
    }
}
