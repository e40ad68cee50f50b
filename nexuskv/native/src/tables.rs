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

use std::alloc::{alloc_zeroed, handle_alloc_error, Layout};


pub const WAYS: usize = 8;
pub const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct W64(pub [u64; WAYS]);

/// Everything of a bucket's slots but their keys, in one cache line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct Meta {
    pub set: [u32; WAYS],
    pub scope: [u16; WAYS], // scope id + 1; 0 marks an empty slot
    pub gen: [u16; WAYS],   // bumped when the slot is emptied
}

/// Scope ids fit 16 bits (id + 1 is stored; 0 marks an empty slot).
pub const MAX_SCOPES: usize = u16::MAX as usize;

/// An engine bucket's block slots (+ 1; 0 marks an empty slot) and their generations, in one
/// cache line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct IdGen {
    pub id1: [u32; WAYS],
    pub gen: [u32; WAYS],
}

#[cfg(target_os = "linux")]
extern "C" {
    fn mmap(addr: *mut std::ffi::c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut std::ffi::c_void;
    fn munmap(addr: *mut std::ffi::c_void, len: usize) -> i32;
    fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
}

const MAP_BYTES: usize = 1 << 20; // arrays from this size up are mapped fresh (zero, untouched)

/// A fixed-size array of `T` whose all-zero bytes are a valid value, zero-initialised without
/// writing: large ones are fresh anonymous mappings advised to use huge pages (a table's random
/// probes then miss the TLB far less often), small ones come from the allocator.
pub struct Buf<T: Copy> {
    ptr: *mut T,
    len: usize,
    mapped: bool,
}

// SAFETY: a Buf owns its memory exclusively, like a Vec.
unsafe impl<T: Copy + Send> Send for Buf<T> {}
unsafe impl<T: Copy + Sync> Sync for Buf<T> {}

impl<T: Copy> Buf<T> {
    pub fn zeroed(len: usize) -> Self {
        let size = std::mem::size_of::<T>() * len;
        if size == 0 {
            return Buf { ptr: std::ptr::NonNull::dangling().as_ptr(), len, mapped: false };
        }
        #[cfg(target_os = "linux")]
        if size >= MAP_BYTES {
            // SAFETY: an anonymous private mapping of `size` bytes, checked for failure; Linux
            // hands out zeroed pages, page-aligned (enough for T's alignment of at most 64).
            unsafe {
                let p = mmap(std::ptr::null_mut(), size, 0x1 | 0x2, 0x02 | 0x20, -1, 0);
                if p as isize != -1 {
                    madvise(p, size, 14 /* MADV_HUGEPAGE */);
                    return Buf { ptr: p as *mut T, len, mapped: true };
                }
            }
        }
        let layout = Layout::array::<T>(len).expect("table size");
        // SAFETY: non-zero layout; all-zero bytes are a valid T for every Buf in this crate.
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            handle_alloc_error(layout);
        }
        Buf { ptr: p as *mut T, len, mapped: false }
    }
}

impl<T: Copy> Default for Buf<T> {
    fn default() -> Self {
        Buf::zeroed(0)
    }
}

impl<T: Copy> Drop for Buf<T> {
    fn drop(&mut self) {
        let size = std::mem::size_of::<T>() * self.len;
        if size == 0 {
            return;
        }
        // SAFETY: releases exactly what `zeroed` obtained, once.
        unsafe {
            #[cfg(target_os = "linux")]
            if self.mapped {
                munmap(self.ptr as *mut std::ffi::c_void, size);
                return;
            }
            std::alloc::dealloc(self.ptr as *mut u8, Layout::array::<T>(self.len).expect("table size"));
        }
    }
}

impl<T: Copy> std::ops::Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised (zero or written) Ts for the Buf's life.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Copy> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as deref, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
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

/// Item indices ordered by home bucket (a counting sort), so a rebuild writes buckets in order.
fn by_home(homes: &[u32], nb: usize) -> Vec<u32> {
    let mut start = vec![0u32; nb + 1];
    for &h in homes {
        start[h as usize + 1] += 1;
    }
    for b in 0..nb {
        start[b + 1] += start[b];
    }
    let mut order = vec![0u32; homes.len()];
    for (i, &h) in homes.iter().enumerate() {
        let at = &mut start[h as usize];
        order[*at as usize] = i as u32;
        *at += 1;
    }
    order
}

/// Buckets that hold `keys` at `max_load / growth` (so the table grows `growth` times at a time).
fn buckets_for(keys: usize, max_load: f64, growth: f64) -> usize {
    let n = (keys as f64 / (max_load / growth) / WAYS as f64) as usize + 1;
    n.max(8)
}

/// Both tables grow 1.5x at a time: between 60% and 90% full, whatever the size.
const BLOCK_GROWTH: f64 = 1.5;
const ENGINE_GROWTH: f64 = 1.5;

/// Blocks: 128-bit (scope-mixed) key, scope and location set per slot, and the slot's
/// generation (bumped when the slot is emptied, so a reference to an emptied slot is detectably
/// stale). A block is named by its slot; slots move only when the table is rebuilt, and the
/// rebuild returns where every slot went.
pub struct BlockTable {
    pub nb: usize,
    pub lo: Buf<W64>,
    pub hi: Buf<W64>,
    pub meta: Buf<Meta>,
    overflow: Vec<bool>,
    n_overflow: usize,
    pub live: usize,
    s0: u64,
    s1: u64,
    pub max_load: f64,
    pub rebuilds: u64,
    pub worn: bool, // a generation neared its end: rebuild (which restarts them) soon
    pub floor: usize, // keys the table was sized for up front (presize): it never shrinks below them
}

impl BlockTable {
    pub fn new(s0: u64, s1: u64, max_load: f64) -> Self {
        let mut t = BlockTable {
            nb: 0,
            lo: Buf::default(),
            hi: Buf::default(),
            meta: Buf::default(),
            overflow: Vec::new(),
            n_overflow: 0,
            live: 0,
            s0,
            s1,
            max_load,
            rebuilds: 0,
            worn: false,
            floor: 0,
        };
        t.allocate(8);
        t
    }

    fn allocate(&mut self, nb: usize) {
        assert!(nb < (1usize << 28), "block table: more than 2**31 slots");
        self.nb = nb;
        self.lo = Buf::zeroed(nb);
        self.hi = Buf::zeroed(nb);
        self.meta = Buf::zeroed(nb);
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
        self.nb * (64 + 64 + 64 + 1)
    }

    #[inline(always)]
    pub fn probe_from(&self, mut b: usize, lo: u64, hi: u64, scope1: u16) -> Option<u32> {
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
    pub fn find(&self, lo: u64, hi: u64, scope1: u16) -> Option<u32> {
        self.probe_from(self.home(lo, hi), lo, hi, scope1)
    }

    /// Insert a key known to be absent (the caller made room with `needs_rebuild`).
    pub fn insert(&mut self, lo: u64, hi: u64, scope1: u16, set: u32) -> u32 {
        self.insert_at(self.home(lo, hi), lo, hi, scope1, set)
    }

    #[inline(always)]
    fn insert_at(&mut self, home: usize, lo: u64, hi: u64, scope1: u16, set: u32) -> u32 {
        let mut b = home;
        loop {
            let m = &self.meta[b];
            if let Some(j) = m.scope.iter().position(|&s| s == 0) {
                self.lo[b].0[j] = lo;
                self.hi[b].0[j] = hi;
                self.meta[b].scope[j] = scope1;
                self.meta[b].set[j] = set;
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

    /// Empty a slot; its generation moves on.
    #[inline(always)]
    pub fn delete(&mut self, slot: u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        self.meta[b].scope[j] = 0;
        self.meta[b].set[j] = 0;
        let g = &mut self.meta[b].gen[j];
        *g = g.wrapping_add(1);
        if *g >= u16::MAX - 1 {
            self.worn = true;
        }
        self.live -= 1;
    }

    #[inline(always)]
    pub fn occupied(&self, slot: u32) -> bool {
        self.meta[slot as usize / WAYS].scope[slot as usize % WAYS] != 0
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
        self.meta[slot as usize / WAYS].scope[slot as usize % WAYS] as u32
    }

    #[inline(always)]
    pub fn gen_of(&self, slot: u32) -> u32 {
        self.meta[slot as usize / WAYS].gen[slot as usize % WAYS] as u32
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
        self.nb > 64 && self.live.max(self.floor) * 8 < self.capacity()
    }

    /// Rebuild for `keys` keys. Returns, per old slot, its new slot (NONE: it was empty) and
    /// the old slots' generations; every moved block starts at generation 0 in its new slot.
    pub fn rebuild(&mut self, keys: usize) -> (Vec<u32>, Vec<u16>) {
        let mut items: Vec<(u64, u64, u16, u32, u32)> = Vec::with_capacity(self.live);
        for b in 0..self.nb {
            let m = &self.meta[b];
            for j in 0..WAYS {
                if m.scope[j] != 0 {
                    items.push((self.lo[b].0[j], self.hi[b].0[j], m.scope[j], m.set[j], (b * WAYS + j) as u32));
                }
            }
        }
        let old_cap = self.capacity();
        let old_gen: Vec<u16> = self.meta.iter().flat_map(|m| m.gen).collect();
        let live = self.live;
        self.lo = Buf::default();
        self.hi = Buf::default();
        self.meta = Buf::default();
        self.allocate(buckets_for(keys.max(live), self.max_load, BLOCK_GROWTH));
        self.live = 0;
        self.rebuilds += 1;
        self.worn = false;
        let mut map = vec![NONE; old_cap];
        let homes: Vec<u32> = items.iter().map(|&(lo, hi, ..)| self.home(lo, hi) as u32).collect();
        // Buckets in order: each takes the items carried from earlier buckets, then its own.
        let order = by_home(&homes, self.nb);
        let mut carry: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
        let mut k = 0;
        for b in 0..self.nb {
            while k < order.len() && homes[order[k] as usize] as usize == b {
                carry.push_back(order[k]);
                k += 1;
            }
            if let Some(&ahead) = order.get(k + 32) {
                prefetch(&map[items[ahead as usize].4 as usize]);
            }
            let mut j = 0;
            while j < WAYS {
                let Some(i) = carry.pop_front() else { break };
                let (lo, hi, s1, set, old) = items[i as usize];
                self.lo[b].0[j] = lo;
                self.hi[b].0[j] = hi;
                self.meta[b].scope[j] = s1;
                self.meta[b].set[j] = set;
                map[old as usize] = (b * WAYS + j) as u32;
                j += 1;
            }
            self.live += j;
            if !carry.is_empty() {
                self.overflow[b] = true;
                self.n_overflow += 1;
            }
        }
        for i in carry {
            // Spilled past the last bucket: probe on from the start like any insert.
            let (lo, hi, s1, set, old) = items[i as usize];
            map[old as usize] = self.insert_at(self.nb - 1, lo, hi, s1, set);
        }
        (map, old_gen)
    }

    #[inline(always)]
    pub fn prefetch_bucket(&self, b: usize) {
        prefetch(&self.lo[b]);
        prefetch(&self.hi[b]);
        prefetch(&self.meta[b]);
    }
}

/// One publisher's engine hashes: 64-bit hash -> (block id, block generation).
pub struct EngineMap {
    nb: usize,
    h: Buf<W64>,
    ig: Buf<IdGen>,
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
            h: Buf::default(),
            ig: Buf::default(),
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
        self.h = Buf::zeroed(nb);
        self.ig = Buf::zeroed(nb);
        self.overflow = vec![false; nb];
        self.n_overflow = 0;
    }

    pub fn nbytes(&self) -> usize {
        self.nb * (64 + 64 + 1)
    }

    pub fn capacity(&self) -> usize {
        self.nb * WAYS
    }

    #[inline(always)]
    pub fn home(&self, h: u64) -> usize {
        reduce(hash64(h, self.s0, self.s1), self.nb)
    }

    #[inline(always)]
    pub fn prefetch_home(&self, h: u64) {
        let b = self.home(h);
        prefetch(&self.h[b]);
        prefetch(&self.ig[b]);
    }

    pub fn find(&self, h: u64) -> Option<u32> {
        let mut b = self.home(h);
        loop {
            for j in 0..WAYS {
                if self.h[b].0[j] == h && self.ig[b].id1[j] != 0 {
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
        (self.ig[b].id1[j].wrapping_sub(1), self.ig[b].gen[j])
    }

    #[inline(always)]
    pub fn hash_at(&self, slot: u32) -> u64 {
        self.h[slot as usize / WAYS].0[slot as usize % WAYS]
    }

    #[inline(always)]
    pub fn put(&mut self, slot: u32, id: u32, gen: u32) {
        let (b, j) = (slot as usize / WAYS, slot as usize % WAYS);
        self.ig[b].id1[j] = id + 1;
        self.ig[b].gen[j] = gen;
    }

    /// Insert a hash known to be absent; when the map must grow first, `keep` decides which old
    /// entries survive (None: all of them).
    pub fn insert(&mut self, h: u64, id: u32, gen: u32, keep: Option<&mut dyn FnMut(u32, u32) -> bool>) -> bool {
        let grew = (self.live + 1) as f64 > self.max_load * self.capacity() as f64 || self.n_overflow * 4 > self.nb;
        if grew {
            match keep {
                Some(k) => self.rebuild(self.live + 1, k),
                None => self.rebuild(self.live + 1, |_, _| true),
            }
        }
        self.place(h, id, gen);
        grew
    }

    fn place(&mut self, h: u64, id: u32, gen: u32) {
        self.place_at(self.home(h), h, id, gen)
    }

    #[inline(always)]
    fn place_at(&mut self, home: usize, h: u64, id: u32, gen: u32) {
        let mut b = home;
        loop {
            if let Some(j) = self.ig[b].id1.iter().position(|&x| x == 0) {
                self.h[b].0[j] = h;
                self.ig[b].id1[j] = id + 1;
                self.ig[b].gen[j] = gen;
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
        self.ig[b].id1[j] = 0;
        self.live -= 1;
    }

    /// Rebuild for `keys` entries, keeping only those `keep(id, gen)` accepts.
    pub fn rebuild(&mut self, keys: usize, mut keep: impl FnMut(u32, u32) -> bool) {
        let mut kept: Vec<(u64, u32, u32)> = Vec::with_capacity(self.live);
        for b in 0..self.nb {
            for j in 0..WAYS {
                let (id, gen) = (self.ig[b].id1[j].wrapping_sub(1), self.ig[b].gen[j]);
                if id != NONE && keep(id, gen) {
                    kept.push((self.h[b].0[j], id, gen));
                }
            }
        }
        let want = keys.saturating_sub(self.live) + kept.len();
        self.h = Buf::default();
        self.ig = Buf::default();
        self.allocate(buckets_for(want, self.max_load, ENGINE_GROWTH));
        self.live = 0;
        let homes: Vec<u32> = kept.iter().map(|&(h, ..)| self.home(h) as u32).collect();
        let order = by_home(&homes, self.nb);
        let mut carry: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
        let mut k = 0;
        for b in 0..self.nb {
            while k < order.len() && homes[order[k] as usize] as usize == b {
                carry.push_back(order[k]);
                k += 1;
            }
            let mut j = 0;
            while j < WAYS {
                let Some(i) = carry.pop_front() else { break };
                let (hh, ii, gg) = kept[i as usize];
                self.h[b].0[j] = hh;
                self.ig[b].id1[j] = ii + 1;
                self.ig[b].gen[j] = gg;
                j += 1;
            }
            self.live += j;
            if !carry.is_empty() {
                self.overflow[b] = true;
                self.n_overflow += 1;
            }
        }
        for i in carry {
            let (hh, ii, gg) = kept[i as usize];
            self.place_at(self.nb - 1, hh, ii, gg);
        }
    }

    pub fn should_shrink(&self) -> bool {
        self.nb > 16 && self.live * 8 < self.capacity()
    }

    /// The block table was rebuilt: point every entry at its block's new slot (generation 0),
    /// dropping entries whose block was gone or whose generation was stale.
    pub fn remap(&mut self, map: &[u32], old_gen: &[u16]) {
        const AHEAD: usize = 32;
        let flat: &mut [u32] = {
            // SAFETY: IdGen is repr(C) of two [u32; WAYS] arrays; viewing the buffer as u32s
            // reaches every id (and gen) word, in order.
            unsafe { std::slice::from_raw_parts_mut(self.ig.as_mut_ptr() as *mut u32, self.ig.len() * 2 * WAYS) }
        };
        let n = flat.len();
        let at = |k: usize| (k / WAYS) * 2 * WAYS + k % WAYS; // the k-th id word
        let slots = n / 2;
        for k in 0..slots {
            if k + AHEAD < slots {
                let id1 = flat[at(k + AHEAD)];
                if id1 != 0 {
                    prefetch(&map[(id1 - 1) as usize]);
                    prefetch(&old_gen[(id1 - 1) as usize]);
                }
            }
            let (ia, ga) = (at(k), at(k) + WAYS);
            let id1 = flat[ia];
            if id1 == 0 {
                continue;
            }
            let id = (id1 - 1) as usize;
            let new = map[id];
            if new == NONE || old_gen[id] as u32 != flat[ga] {
                flat[ia] = 0;
                self.live -= 1;
            } else {
                flat[ia] = new + 1;
                flat[ga] = 0;
            }
        }
    }

    /// Every occupied slot.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nb).flat_map(move |b| {
            (0..WAYS).filter(move |&j| self.ig[b].id1[j] != 0).map(move |j| (b * WAYS + j) as u32)
        })
    }
}
