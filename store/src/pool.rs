//! A slab: values by a small integer key, keys reused after removal. Unlike
//! the `slab` crate's, its entries can be prefetched by key without being
//! read (`slab::Slab::get` reads the entry to know whether it is occupied),
//! which is what a batch of completions needs: the entries of the next few
//! are loaded while the current one is handled.

use std::ops::{Index, IndexMut};

enum Entry<T> {
    Full(T),
    /// The next free key (`usize::MAX`: none).
    Free(usize),
}

pub(crate) struct Pool<T> {
    entries: Vec<Entry<T>>,
    free: usize,
    len: usize,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool {
            entries: Vec::new(),
            free: usize::MAX,
            len: 0,
        }
    }
}

impl<T> Pool<T> {
    pub fn insert(&mut self, v: T) -> usize {
        self.len += 1;
        if self.free == usize::MAX {
            self.entries.push(Entry::Full(v));
            return self.entries.len() - 1;
        }
        let k = self.free;
        match std::mem::replace(&mut self.entries[k], Entry::Full(v)) {
            Entry::Free(next) => self.free = next,
            Entry::Full(_) => unreachable!("the free list holds free entries only"),
        }
        k
    }

    /// Removes and returns the value at `k`; panics if there is none (a
    /// key the caller no longer holds).
    pub fn remove(&mut self, k: usize) -> T {
        match std::mem::replace(&mut self.entries[k], Entry::Free(self.free)) {
            Entry::Full(v) => {
                self.free = k;
                self.len -= 1;
                v
            }
            Entry::Free(next) => {
                self.entries[k] = Entry::Free(next);
                panic!("pool key {k} is not in use");
            }
        }
    }

    pub fn get(&self, k: usize) -> Option<&T> {
        match self.entries.get(k) {
            Some(Entry::Full(v)) => Some(v),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Starts loading the first `lines` cache lines of entry `k`, without
    /// reading it.
    #[inline]
    pub fn prefetch(&self, k: usize, lines: usize) {
        if let Some(e) = self.entries.get(k) {
            crate::prefetch::value(e, lines);
        }
    }
}

impl<T> Index<usize> for Pool<T> {
    type Output = T;
    fn index(&self, k: usize) -> &T {
        self.get(k)
            .unwrap_or_else(|| panic!("pool key {k} is not in use"))
    }
}

impl<T> IndexMut<usize> for Pool<T> {
    fn index_mut(&mut self, k: usize) -> &mut T {
        match self.entries.get_mut(k) {
            Some(Entry::Full(v)) => v,
            _ => panic!("pool key {k} is not in use"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_reused_and_values_kept() {
        let mut p = Pool::default();
        let a = p.insert("a");
        let b = p.insert("b");
        let c = p.insert("c");
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(p.remove(b), "b");
        assert_eq!(p.get(b), None);
        assert_eq!(p.len(), 2);
        let d = p.insert("d");
        assert_eq!(d, b, "the freed key comes back");
        assert_eq!((p[a], p[c], p[d]), ("a", "c", "d"));
        p.remove(a);
        p.remove(c);
        assert_eq!((p.insert("e"), p.insert("f"), p.insert("g")), (c, a, 3));
        p.prefetch(1000, 2);
    }

    #[test]
    #[should_panic(expected = "not in use")]
    fn removing_a_free_key_panics() {
        let mut p = Pool::default();
        let a = p.insert(1);
        p.remove(a);
        p.remove(a);
    }
}
