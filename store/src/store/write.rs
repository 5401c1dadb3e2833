//! Writes: applied to the active memtable at once; a full memtable is frozen.

use super::*;

impl<I: Io> Store<I> {
    pub(super) fn check_memory(&self) -> Result<(), StoreError> {
        if let Some(e) = &self.stats.last_background_error {
            let m = self.memory();
            if m.memtables > self.cfg.memory_budget {
                return Err(StoreError::OverBudget {
                    used: m.memtables,
                    budget: self.cfg.memory_budget,
                    cause: Box::new(e.clone()),
                });
            }
        }
        Ok(())
    }

    pub(super) fn apply_write(&mut self, op: &Op<'_>) -> Result<(), StoreError> {
        let kb = match *op {
            Op::Put(k, _)
            | Op::Delete(k)
            | Op::ListAppend(k, _)
            | Op::ListAppendAll(k, _)
            | Op::ListReplace(k, _)
            | Op::Clear(k, _) => KeyBuf::encode(&k, None)?,
            Op::MapPut(k, u, _) | Op::MapRemove(k, u) => KeyBuf::encode(&k, Some(u))?,
            Op::DeleteKeyGroups { lo, hi } => {
                if lo > hi {
                    return Err(StoreError::Invalid("key-group range with lo > hi"));
                }
                return self.delete_key_groups(lo, hi);
            }
            _ => return Err(StoreError::Invalid("not a write")),
        };
        let key = kb.as_slice();
        self.apply_keyed(op, key, bloom::hash(key))
    }

    /// Applies keyed write `op` whose key is encoded as `key` (hash `h`,
    /// `bloom::hash(key)`): [`Store::submit_batch`] encodes a batch's keys
    /// together and prefetches their slots before it gets here.
    pub(super) fn apply_keyed(
        &mut self,
        op: &Op<'_>,
        key: &[u8],
        h: u64,
    ) -> Result<(), StoreError> {
        match *op {
            Op::Put(_, v) => {
                check_value(v)?;
                self.active.write(Kind::Put, key, h, v);
            }
            Op::Delete(_) => self.active.write(Kind::Delete, key, h, &[]),
            Op::ListAppend(_, e) => {
                check_value(e)?;
                let head = self.active.list_head(key, h);
                self.check_list_room(key, h, 4 + e.len(), head.map(|x| x.bytes))?;
                self.scratch.clear();
                encode_element(&mut self.scratch, e);
                let operand = std::mem::take(&mut self.scratch);
                self.active.merge_onto(key, h, head, &operand);
                self.scratch = operand;
            }
            Op::ListAppendAll(_, list) => {
                check_value(list)?;
                crate::ops::check_elements(list)
                    .ok_or(StoreError::Invalid("malformed element list"))?;
                let head = self.active.list_head(key, h);
                self.check_list_room(key, h, list.len(), head.map(|x| x.bytes))?;
                // The operand is already what a list's operands join into.
                if !list.is_empty() {
                    self.active.merge_onto(key, h, head, list);
                }
            }
            Op::ListReplace(_, list) => {
                check_value(list)?;
                crate::ops::check_elements(list)
                    .ok_or(StoreError::Invalid("malformed element list"))?;
                self.check_list_len(list.len())?;
                let kind = if list.is_empty() {
                    Kind::Delete
                } else {
                    Kind::Put
                };
                self.active.write(kind, key, h, list);
            }
            Op::MapPut(_, _, v) => {
                check_value(v)?;
                self.active.write_map_entry(Kind::Put, key, h, v);
            }
            Op::MapRemove(..) => self.active.write_map_entry(Kind::Delete, key, h, &[]),
            Op::Clear(_, kind) => match kind {
                StateKind::Map => self.active.clear_map(key),
                StateKind::Value | StateKind::List => self.active.write(Kind::Delete, key, h, &[]),
            },
            _ => return Err(StoreError::Invalid("not a keyed write")),
        }
        Ok(())
    }

    pub(super) fn delete_key_groups(&mut self, lo: u16, hi: u16) -> Result<(), StoreError> {
        // Every older layer (frozen memtables and segments, which already
        // have orders) is masked (durable in the background, before any
        // newer layer: see `layers`). Then the active memtable drops its
        // records.
        let max_order = self.next_order - 1;
        self.push_mask(KgDelete {
            region: Region {
                lo,
                hi,
                states: None,
            },
            max_order,
        });
        self.active.delete_key_groups(lo, hi);
        Ok(())
    }

    /// Adds a mask; the layer list is made durable in the background (see
    /// `layers`). Restored layers the mask hides entirely are dropped with
    /// it (retired once the list is durable), so repeated restores do not
    /// pile up layers and open files.
    pub(super) fn push_mask(&mut self, m: KgDelete) {
        let compacting: Vec<u64> = self
            .compact
            .as_ref()
            .map(|j| j.inputs.iter().map(|s| s.id).collect())
            .unwrap_or_default();
        let hidden = |s: &Rc<Segment>| {
            s.footer.order <= m.max_order
                && s.clip.as_ref().is_some_and(|c| m.region.covers(&c.keep))
                && !compacting.contains(&s.id)
        };
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.segments)
            .into_iter()
            .partition(hidden);
        self.segments = kept;
        // A mask of the same region with a newer max_order replaces an
        // older one (repeated restores of one range do not pile up masks).
        self.kg_deletes.retain(|d| d.region != m.region);
        self.kg_deletes.push(m);
        self.layers.changed(gone);
    }

    /// Forgets key-group deletes that no layer is old enough to be under.
    pub(super) fn prune_kg_deletes(&mut self) {
        let oldest = self
            .segments
            .iter()
            .map(|s| s.footer.order)
            .chain(self.frozen.iter().map(|(o, _)| *o))
            .chain(self.retired.iter().map(|s| s.footer.order))
            .chain(self.awaiting_dir_sync.iter().map(|s| s.footer.order))
            .min()
            .unwrap_or(u64::MAX);
        let before = self.kg_deletes.len();
        self.kg_deletes.retain(|d| d.max_order >= oldest);
        if self.kg_deletes.len() != before {
            self.layers.changed(Vec::new());
        }
    }

    pub(super) fn after_write(&mut self) {
        if self.active.log_bytes() >= self.memtable_limit() {
            self.freeze();
        }
        let reuse = &self.reuse;
        if let Some((addr, len)) = self.active.keep_spares(|| reuse.take_chunk()) {
            self.io.prefault(addr, len);
        }
        if !self.next_index_looked && self.active.log_bytes() >= self.memtable_limit() / 2 {
            self.make_next_index();
        }
    }

    /// Half way to its freeze, the active memtable's successor gets its
    /// index made and prefaulted (off this thread), unless a flushed
    /// memtable's will be there: a fresh index faulted in by the first
    /// writes after the freeze stopped the shard for 120 ms (a zero-fill
    /// per 2 MiB page as writes land at random, benches/RESULTS.md). Only
    /// while no memtable is frozen: the memory plans two indexes.
    fn make_next_index(&mut self) {
        self.next_index_looked = true;
        let len = Memtable::index_len(initial_entries(&self.cfg));
        if !self.frozen.is_empty() || self.reuse.has_index(len) {
            return;
        }
        let index = HugeArray::zeroed(len);
        self.io.prefault(index.as_ptr() as usize, len * 8);
        self.next_index = Some(index);
        self.rebalance_cache();
    }

    /// See `StoreConfig::prefault_memory`: the active memtable's index,
    /// the next one's, and two memtables' worth of log chunks in the pool
    /// (within the memory plan: two memtables and their indexes).
    pub(super) fn prefault_memory(&mut self) {
        self.active.populate_index();
        self.reuse.fill();
        let mut next = HugeArray::zeroed(Memtable::index_len(initial_entries(&self.cfg)));
        next.populate();
        self.next_index = Some(next);
        self.next_index_looked = true;
        self.rebalance_cache();
    }

    pub(super) fn freeze(&mut self) {
        if self.active.is_empty() {
            return;
        }
        // A memtable frozen before it filled (a checkpoint, a restore) says
        // how many keys arrive between two of them: the next index starts
        // at twice that, not at the size a full memtable needs, so frequent
        // checkpoints do not allocate and zero a large index each time.
        let full = initial_entries(&self.cfg);
        let entries = if self.active.log_bytes() >= self.memtable_limit() {
            full
        } else {
            (self.active.len() * 2).max(1 << 14).min(full)
        };
        let len = Memtable::index_len(entries);
        self.next_index_looked = false;
        let made = self.next_index.take().filter(|i| i.len() == len);
        let index = made.or_else(|| self.reuse.take_index(len));
        let fresh = index.is_none();
        let mut m = std::mem::replace(&mut self.active, Memtable::with_index(entries, index));
        m.give_spares(&mut self.active);
        if fresh {
            let (addr, len) = self.active.index_range();
            self.io.prefault(addr, len);
        }
        let order = self.next_order;
        self.next_order += 1;
        self.frozen.insert(0, (order, Arc::new(m)));
        self.rebalance_cache();
    }

    /// Applies all writes of `batch` or none: every operation is checked
    /// first, then all are applied before any read can observe them.
    pub fn write_batch(&mut self, batch: &[Op<'_>]) -> Result<(), StoreError> {
        self.check_memory()?;
        // What the batch so far did to each list it touched: each append
        // is checked against the cap as the batch applied up to it, so the
        // batch is refused whole rather than cut short.
        let mut lists: HashMap<Vec<u8>, ListBytes> = HashMap::new();
        for op in batch {
            match *op {
                Op::Put(k, v)
                | Op::ListAppend(k, v)
                | Op::ListAppendAll(k, v)
                | Op::ListReplace(k, v) => {
                    let key = encode(&k, None)?;
                    check_value(v)?;
                    if let Op::ListReplace(_, l) | Op::ListAppendAll(_, l) = op {
                        crate::ops::check_elements(l)
                            .ok_or(StoreError::Invalid("malformed element list"))?;
                    }
                    let (add, decided) = match op {
                        Op::ListAppend(..) => (4 + v.len(), false),
                        Op::ListAppendAll(..) => (v.len(), false),
                        Op::ListReplace(..) => {
                            self.check_list_len(v.len())?;
                            (v.len(), true)
                        }
                        _ => (v.len(), true),
                    };
                    let l = lists.entry(key.clone()).or_default();
                    if decided {
                        *l = ListBytes {
                            bytes: add as u64,
                            decided,
                        };
                        continue;
                    }
                    l.bytes += add as u64;
                    let l = *l;
                    if l.decided {
                        self.check_list_len(l.bytes as usize)?;
                    } else {
                        let h = bloom::hash(&key);
                        let active = self.active.list_bytes(&key, h);
                        self.check_list_room(&key, h, l.bytes as usize, active)?;
                    }
                }
                Op::Delete(k) | Op::Clear(k, _) => {
                    lists.insert(
                        encode(&k, None)?,
                        ListBytes {
                            bytes: 0,
                            decided: true,
                        },
                    );
                }
                Op::MapPut(k, u, v) => {
                    encode(&k, Some(u))?;
                    check_value(v)?;
                }
                Op::MapRemove(k, u) => {
                    encode(&k, Some(u))?;
                }
                Op::DeleteKeyGroups { lo, hi } if lo <= hi => {}
                _ => return Err(StoreError::Invalid("a batch holds only writes")),
            }
        }
        for op in batch {
            self.apply_write(op)?;
        }
        self.after_write();
        Ok(())
    }
}
