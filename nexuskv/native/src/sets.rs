//! Interned location sets: a block points at one set id (a u32) instead of holding one entry
//! per membership. Set 0 is the empty set. A set is counted by the blocks that point at it and
//! recycled when none does; ids freed during one core call are only reused after it
//! (`flush`), so an id seen earlier in the call still names the same set.

use std::collections::HashMap;

pub struct Sets {
    pub locs: Vec<Box<[u32]>>,
    refs: Vec<u64>,
    by: HashMap<Box<[u32]>, u32>,
    free: Vec<u32>,
    pending: Vec<u32>,
}

impl Sets {
    pub fn new() -> Self {
        let mut by = HashMap::new();
        by.insert(Vec::new().into_boxed_slice(), 0u32);
        Sets { locs: vec![Vec::new().into_boxed_slice()], refs: vec![0], by, free: Vec::new(), pending: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.by.len()
    }

    #[inline(always)]
    pub fn get(&self, s: u32) -> &[u32] {
        &self.locs[s as usize]
    }

    pub fn intern(&mut self, locs: &[u32]) -> u32 {
        if let Some(&s) = self.by.get(locs) {
            return s;
        }
        let boxed: Box<[u32]> = locs.to_vec().into_boxed_slice();
        let s = match self.free.pop() {
            Some(s) => {
                self.locs[s as usize] = boxed.clone();
                self.refs[s as usize] = 0;
                s
            }
            None => {
                self.locs.push(boxed.clone());
                self.refs.push(0);
                (self.locs.len() - 1) as u32
            }
        };
        self.by.insert(boxed, s);
        s
    }

    pub fn with_loc(&mut self, s: u32, loc: u32) -> u32 {
        let cur = &self.locs[s as usize];
        match cur.binary_search(&loc) {
            Ok(_) => s,
            Err(pos) => {
                let mut v = Vec::with_capacity(cur.len() + 1);
                v.extend_from_slice(&cur[..pos]);
                v.push(loc);
                v.extend_from_slice(&cur[pos..]);
                self.intern(&v)
            }
        }
    }

    pub fn without_loc(&mut self, s: u32, loc: u32) -> u32 {
        let cur = &self.locs[s as usize];
        match cur.binary_search(&loc) {
            Err(_) => s,
            Ok(pos) => {
                let mut v = Vec::with_capacity(cur.len());
                v.extend_from_slice(&cur[..pos]);
                v.extend_from_slice(&cur[pos + 1..]);
                self.intern(&v)
            }
        }
    }

    /// The set without every location of publisher `publ`.
    pub fn without_pub(&mut self, s: u32, publ: u32, loc_pub: &[u32]) -> u32 {
        let cur = &self.locs[s as usize];
        if !cur.iter().any(|&l| loc_pub[l as usize] == publ) {
            return s;
        }
        let v: Vec<u32> = cur.iter().copied().filter(|&l| loc_pub[l as usize] != publ).collect();
        self.intern(&v)
    }

    #[inline(always)]
    pub fn holds_pub(&self, s: u32, publ: u32, loc_pub: &[u32]) -> bool {
        self.locs[s as usize].iter().any(|&l| loc_pub[l as usize] == publ)
    }

    #[inline(always)]
    pub fn retain(&mut self, s: u32, delta: i64) {
        if s == 0 {
            return;
        }
        let r = &mut self.refs[s as usize];
        *r = (*r as i64 + delta) as u64;
        if *r == 0 {
            self.pending.push(s);
        }
    }

    /// Recycle the sets that lost their last block during this call.
    pub fn flush(&mut self) {
        while let Some(s) = self.pending.pop() {
            if self.refs[s as usize] == 0 && s != 0 {
                let locs = std::mem::replace(&mut self.locs[s as usize], Vec::new().into_boxed_slice());
                if self.by.get(&locs) == Some(&s) {
                    self.by.remove(&locs);
                    self.free.push(s);
                } else {
                    self.locs[s as usize] = locs;
                }
            }
        }
    }

    pub fn nbytes(&self) -> usize {
        let locs: usize = self.locs.iter().map(|l| l.len() * 4).sum();
        // Box headers and refs per set, the map's entries (key box, id, control byte) and lists.
        self.locs.capacity() * 16 + self.refs.capacity() * 8 + locs * 2 + self.by.capacity() * 25
            + (self.free.capacity() + self.pending.capacity()) * 4
    }
}
