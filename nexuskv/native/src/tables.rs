//! Two open-addressing tables over 8-slot buckets, laid out column-wise per bucket so that a
//! probe reads one 64-byte line of first key words and only touches the rest on a match.
//!
//! A key lives in the first bucket of its probe sequence (home bucket, then the next ones) that
//! had room when it was inserted; a bucket that ever turned a key away is flagged *overflowed*,
//! and only then does a search continue past it. Deleting empties the slot (no tombstones, no
//! moves); the flags are reset by the next rebuild, which happens when the table grows, when a
//! quarter of its buckets are flagged, or when it shrinks. The bucket of a key comes from a
//! seeded folded multiply of its words: keys chosen by a publisher cannot be steered into one
//! bucket without the seed.

pub const WAYS: usize = 8;
pub const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct W64(pub [u64; WAYS]);

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct Meta {
    pub set: [u32; WAYS],
    pub scope: [u32; WAYS], // scope id + 1; 0 marks an empty slot
}

#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct W32(pub [u32; WAYS]);

impl Default for W32 {
    fn default() -> Self {
        W32([NONE; WAYS])
    }
}

#[inline(always)]
pub fn fold_mul(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xBF58_476D_1CE4_E5B9;

/// Seeded hash of a 128-bit key: two folded multiplies, every input bit reaches the high bits.
#[inline(always)]
fn hash128(lo: u64, hi: u64, s0: u64, s1: u64) -> u64 {
    fold_mul(fold_mul(lo ^ s0, (K1 ^ s1) | 1) ^ hi, K2)
}

#[inline(always)]
fn hash64(x: u64, s0: u64, s1: u64) -> u64 {
    fold_mul(fold_mul(x ^ s0, (K1 ^ s1) | 1), K2)
}

#[inline(always)]
fn reduce(h: u64, nb: usize) -> usize {
    (((h >> 32) * nb as u64) >> 32) as usize
}

#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
    }
}

/// Buckets that hold `keys` at two thirds of `max_load` (so growth is 1.5x at a time).
fn buckets_for(keys: usize, max_load: f64) -> usize {
    let n = (keys as f64 / (max_load * 2.0 / 3.0) / WAYS as f64) as usize + 1;
    n.max(8)
}

/// Blocks: 128-bit (scope-mixed) key, scope, location set and a stable block id per slot.
pub struct BlockTable {
    pub nb: usize,
    pub lo: Vec<W64>,
    pub hi: Vec<W64>,
    pub meta: Vec<Meta>,
    pub ids: Vec<W32>,
    overflow: Vec<bool>,
    n_overflow: usize,
    pub live: usize,
    s0: u64,
    s1: u64,
    pub max_load: f64,
    pub rebuilds: u64,
}

impl BlockTable {
    pub fn new(s0: u64, s1: u64, max_load: f64) -> Self {
        let mut t = BlockTable {
            nb: 0,
            lo: Vec::new(),
            hi: Vec::new(),
            meta: Vec::new(),
            ids: Vec::new(),
            overflow: Vec::new(),
            n_overflow: 0,
            live: 0,
            s0,
            s1,
            max_load,
            rebuilds: 0,
        };
        t.allocate(8);
        t
    }

    fn allocate(&mut self, nb: usize) {
        assert!(nb < (1usize << 31), "block table: more than 2**31 buckets");
        self.nb = nb;
        self.lo = vec![W64::default(); nb];
        self.hi = vec![W64::default(); nb];
        self.meta = vec![Meta::default(); nb];
        self.ids = vec![W32::default(); nb];
        self.overflow = vec![false; nb];
        self.n_overflow = 0;
    }

    #[inline(always)]
    pub fn home(&self, lo: u64, hi: u64) -> usize {
        reduce(hash128(lo, hi, self.s0, self.s1), self.nb)
    }

    pub fn capacity(&self) -> usize {
        self.nb * WAYS
    }

    pub fn nbytes(&self) -> usize {
        self.nb * (64 + 64 + 64 + 32 + 1)
    }

    #[inline(always)]
    pub fn probe_from(&self, mut b: usize, lo: u64, hi: u64, scope1: u32) -> Option<u32> {
        loop {
            let row = &self.lo[b].0;
            let mut mask = 0u32;
            for (j, &w) in row.iter().enumerate() {
                mask |= ((w == lo) as u32) << j;
            }
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                if self.hi[b].0[j] == hi && self.meta[b].scope[j] == scope1 {
                    return Some((b * WAYS + j) as u32);
                }
            }
            if !self.overflow[b] {
                return None;
            }
            b += 1;
            if b == self.nb {
                b = 0;
            }
        }
    }

    #[inline(always)]
    pub fn find(&self, lo: u64, hi: u64, scope1: u32) -> Option<u32> {
        self.probe_from(self.home(lo, hi), lo, hi, scope1)
    }

    /// Insert a key known to be absent (the caller made room with `needs_rebuild`).
    pub fn insert(&mut self, lo: u64, hi: u64, scope1: u32, set: u32, id: u32) -> u32 {
        let mut b = self.home(lo, hi);
        loop {
            let m = &self.meta[b];
            if let Some(j) = m.scope.iter().position(|&s| s == 0) {
                self.lo[b].0[j] = lo;
                self.hi[b].0[j] = hi;
                self.meta[b].scope[j] = scope1;
                self.meta[b].set[j] = set;
                self.ids[b].0[j] = id;
                self.live += 1;
                return (b * WAYS + j) as u32;
            }
            if !self.overflow[b] {
                self.overflow[b] = true;
                self.n_overflow += 1;
            }
            b += 1;
            if b == self.nb {
                b = 0;
            }
        }
    }

    #[inline(always)]
    pub fn delete(&mut self, slot: u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        self.meta[b].scope[j] = 0;
        self.meta[b].set[j] = 0;
        self.ids[b].0[j] = NONE;
        self.live -= 1;
    }

    #[inline(always)]
    pub fn set_of(&self, slot: u32) -> u32 {
        self.meta[slot as usize / WAYS].set[slot as usize % WAYS]
    }

    #[inline(always)]
    pub fn put_set(&mut self, slot: u32, set: u32) {
        self.meta[slot as usize / WAYS].set[slot as usize % WAYS] = set;
    }

    #[inline(always)]
    pub fn scope1_of(&self, slot: u32) -> u32 {
        self.meta[slot as usize / WAYS].scope[slot as usize % WAYS]
    }

    #[inline(always)]
    pub fn id_of(&self, slot: u32) -> u32 {
        self.ids[slot as usize / WAYS].0[slot as usize % WAYS]
    }

    #[inline(always)]
    pub fn key_of(&self, slot: u32) -> (u64, u64) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        (self.lo[b].0[j], self.hi[b].0[j])
    }

    /// Room for `extra` more keys without passing the load bound or the overflow bound?
    pub fn needs_rebuild(&self, extra: usize) -> bool {
        (self.live + extra) as f64 > self.max_load * self.capacity() as f64 || self.n_overflow * 4 > self.nb
    }

    pub fn should_shrink(&self) -> bool {
        self.nb > 64 && self.live * 8 < self.capacity()
    }

    /// Rebuild for `keys` keys; `moved(id, new_slot)` is told where every key went.
    pub fn rebuild(&mut self, keys: usize, mut moved: impl FnMut(u32, u32)) {
        let lo = std::mem::take(&mut self.lo);
        let hi = std::mem::take(&mut self.hi);
        let meta = std::mem::take(&mut self.meta);
        let ids = std::mem::take(&mut self.ids);
        let live = self.live;
        self.allocate(buckets_for(keys.max(live), self.max_load));
        self.live = 0;
        self.rebuilds += 1;
        for b in 0..meta.len() {
            for j in 0..WAYS {
                let s1 = meta[b].scope[j];
                if s1 != 0 {
                    let id = ids[b].0[j];
                    let slot = self.insert(lo[b].0[j], hi[b].0[j], s1, meta[b].set[j], id);
                    moved(id, slot);
                }
            }
        }
    }
}

/// One publisher's engine hashes: 64-bit hash -> (block id, block generation).
pub struct EngineMap {
    nb: usize,
    h: Vec<W64>,
    id: Vec<W32>,
    gen: Vec<W32>,
    overflow: Vec<bool>,
    n_overflow: usize,
    pub live: usize,
    s0: u64,
    s1: u64,
    max_load: f64,
}

impl EngineMap {
    pub fn new(s0: u64, s1: u64, max_load: f64) -> Self {
        let mut m = EngineMap {
            nb: 0,
            h: Vec::new(),
            id: Vec::new(),
            gen: Vec::new(),
            overflow: Vec::new(),
            n_overflow: 0,
            live: 0,
            s0,
            s1,
            max_load,
        };
        m.allocate(2);
        m
    }

    fn allocate(&mut self, nb: usize) {
        assert!(nb < (1usize << 31), "engine map: more than 2**31 buckets");
        self.nb = nb;
        self.h = vec![W64::default(); nb];
        self.id = vec![W32::default(); nb];
        self.gen = vec![W32([0; WAYS]); nb];
        self.overflow = vec![false; nb];
        self.n_overflow = 0;
    }

    pub fn nbytes(&self) -> usize {
        self.nb * (64 + 32 + 32 + 1)
    }

    pub fn capacity(&self) -> usize {
        self.nb * WAYS
    }

    #[inline(always)]
    fn home(&self, h: u64) -> usize {
        reduce(hash64(h, self.s0, self.s1), self.nb)
    }

    pub fn find(&self, h: u64) -> Option<u32> {
        let mut b = self.home(h);
        loop {
            for j in 0..WAYS {
                if self.h[b].0[j] == h && self.id[b].0[j] != NONE {
                    return Some((b * WAYS + j) as u32);
                }
            }
            if !self.overflow[b] {
                return None;
            }
            b += 1;
            if b == self.nb {
                b = 0;
            }
        }
    }

    #[inline(always)]
    pub fn get(&self, slot: u32) -> (u32, u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        (self.id[b].0[j], self.gen[b].0[j])
    }

    #[inline(always)]
    pub fn hash_at(&self, slot: u32) -> u64 {
        self.h[slot as usize / WAYS].0[slot as usize % WAYS]
    }

    #[inline(always)]
    pub fn put(&mut self, slot: u32, id: u32, gen: u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        self.id[b].0[j] = id;
        self.gen[b].0[j] = gen;
    }

    /// Insert a hash known to be absent; `keep` decides which old entries survive a rebuild.
    pub fn insert(&mut self, h: u64, id: u32, gen: u32, keep: impl FnMut(u32, u32) -> bool) {
        if (self.live + 1) as f64 > self.max_load * self.capacity() as f64 || self.n_overflow * 4 > self.nb {
            self.rebuild(self.live + 1, keep);
        }
        self.place(h, id, gen);
    }

    fn place(&mut self, h: u64, id: u32, gen: u32) {
        let mut b = self.home(h);
        loop {
            if let Some(j) = self.id[b].0.iter().position(|&x| x == NONE) {
                self.h[b].0[j] = h;
                self.id[b].0[j] = id;
                self.gen[b].0[j] = gen;
                self.live += 1;
                return;
            }
            if !self.overflow[b] {
                self.overflow[b] = true;
                self.n_overflow += 1;
            }
            b += 1;
            if b == self.nb {
                b = 0;
            }
        }
    }

    pub fn delete(&mut self, slot: u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        self.id[b].0[j] = NONE;
        self.live -= 1;
    }

    /// Rebuild for `keys` entries, keeping only those `keep(id, gen)` accepts.
    pub fn rebuild(&mut self, keys: usize, mut keep: impl FnMut(u32, u32) -> bool) {
        let h = std::mem::take(&mut self.h);
        let id = std::mem::take(&mut self.id);
        let gen = std::mem::take(&mut self.gen);
        let mut kept: Vec<(u64, u32, u32)> = Vec::with_capacity(self.live);
        for b in 0..id.len() {
            for j in 0..WAYS {
                if id[b].0[j] != NONE && keep(id[b].0[j], gen[b].0[j]) {
                    kept.push((h[b].0[j], id[b].0[j], gen[b].0[j]));
                }
            }
        }
        let want = keys.saturating_sub(self.live) + kept.len();
        self.allocate(buckets_for(want, self.max_load));
        self.live = 0;
        for (hh, ii, gg) in kept {
            self.place(hh, ii, gg);
        }
    }

    pub fn should_shrink(&self) -> bool {
        self.nb > 16 && self.live * 8 < self.capacity()
    }

    /// Every occupied slot.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nb).flat_map(move |b| {
            (0..WAYS).filter(move |&j| self.id[b].0[j] != NONE).map(move |j| (b * WAYS + j) as u32)
        })
    }
}
