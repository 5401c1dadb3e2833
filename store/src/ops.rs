//! What callers submit and what they get back.

/// The kind of a registered state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateKind {
    Value,
    List,
    Map,
}

/// The identity of a value, list or map: `(key group, state, key, namespace)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRef<'a> {
    pub key_group: u16,
    pub state: u32,
    pub key: &'a [u8],
    pub namespace: &'a [u8],
}

/// What a map iteration returns per entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IterMode {
    /// `u32 len | user key` per entry.
    Keys,
    /// `u32 len | value` per entry.
    Values,
    /// `u32 len | user key | u32 len | value` per entry.
    Entries,
}

/// One operation.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    Get(KeyRef<'a>),
    Put(KeyRef<'a>, &'a [u8]),
    Delete(KeyRef<'a>),
    /// Appends one element.
    ListAppend(KeyRef<'a>, &'a [u8]),
    /// Appends an encoded element list (`u32 len | bytes` each), in order.
    ListAppendAll(KeyRef<'a>, &'a [u8]),
    /// All elements, encoded `u32 len | bytes` each.
    ListGet(KeyRef<'a>),
    /// Replaces all elements with an encoded element list (empty: delete).
    ListReplace(KeyRef<'a>, &'a [u8]),
    MapGet(KeyRef<'a>, &'a [u8]),
    MapPut(KeyRef<'a>, &'a [u8], &'a [u8]),
    MapRemove(KeyRef<'a>, &'a [u8]),
    MapContains(KeyRef<'a>, &'a [u8]),
    /// One page of a map: entries after `after` (exclusive), at most
    /// `max_bytes` of encoded output.
    MapIter {
        map: KeyRef<'a>,
        mode: IterMode,
        after: Option<&'a [u8]>,
        max_bytes: usize,
    },
    /// Removes everything of `(key, namespace)` in a state of this kind.
    Clear(KeyRef<'a>, StateKind),
    /// Removes every entry of key groups `lo..=hi`.
    DeleteKeyGroups {
        lo: u16,
        hi: u16,
    },
}

impl Op<'_> {
    /// Whether the operation only reads.
    pub fn is_read(&self) -> bool {
        matches!(
            self,
            Op::Get(_) | Op::ListGet(_) | Op::MapGet(..) | Op::MapContains(..) | Op::MapIter { .. }
        )
    }
}

/// A result, borrowing the store until the next call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output<'a> {
    /// A write was applied.
    Done,
    /// A value (`Get`, `MapGet`) or an encoded element list (`ListGet`);
    /// `None` when absent (an empty list is absent).
    Value(Option<&'a [u8]>),
    /// `MapContains`.
    Contains(bool),
    /// `MapIter`: encoded entries, their count, the last user key of the
    /// page (resume after it), and whether more may follow.
    Page {
        data: &'a [u8],
        entries: u32,
        last_key: &'a [u8],
        more: bool,
    },
    /// A snapshot import was installed.
    Imported(crate::store::Imported),
}

/// What `submit` did.
#[derive(Debug)]
pub enum Submitted<'a> {
    /// Completed at once (memory answered).
    Ready(Output<'a>),
    /// Waits for disk; completes through `poll`.
    Pending,
}

/// Encodes one list element as stored: `u32 LE len | bytes`.
pub fn encode_element(out: &mut Vec<u8>, element: &[u8]) {
    out.extend_from_slice(&(element.len() as u32).to_le_bytes());
    out.extend_from_slice(element);
}

/// Checks an encoded element list; returns the element count.
pub fn check_elements(mut b: &[u8]) -> Option<usize> {
    let mut n = 0;
    while !b.is_empty() {
        let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
        b = b
            .get(4..4usize.checked_add(len)?)?
            .get(..)
            .map(|_| &b[4 + len..])?;
        n += 1;
    }
    Some(n)
}

/// Iterates an encoded element list.
pub fn elements(mut b: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
        let e = b.get(4..4 + len)?;
        b = &b[4 + len..];
        Some(e)
    })
}
