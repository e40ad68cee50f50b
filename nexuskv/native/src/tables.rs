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

/// Types whose all-zero bytes are a valid value, so a [`Buf`] of them may start as zeroed memory
/// that nothing wrote.
///
/// # Safety
///
/// Implement it only for plain data: integers and arrays or `repr(C)` structs of them (no
/// references, pointers, `bool`, `char`, enums or `NonZero*`).
pub unsafe trait Zeroable: Copy {}

// SAFETY: integers are valid for every bit pattern, zero included.
unsafe impl Zeroable for u8 {}
unsafe impl Zeroable for u16 {}
unsafe impl Zeroable for u32 {}
unsafe impl Zeroable for u64 {}
// SAFETY: an array of zeroable values is zeroable.
unsafe impl<T: Zeroable, const N: usize> Zeroable for [T; N] {}

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct W64(pub [u64; WAYS]);

// SAFETY: repr(C) of one [u64; WAYS].
unsafe impl Zeroable for W64 {}

/// Everything of a bucket's slots but their keys, in one cache line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct Meta {
    pub set: [u32; WAYS],
    pub scope: [u16; WAYS], // scope id + 1; 0 marks an empty slot
    pub gen: [u16; WAYS],   // bumped when the slot is emptied
}

// SAFETY: repr(C) of integer arrays; zero is an empty slot.
unsafe impl Zeroable for Meta {}

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

// SAFETY: repr(C) of integer arrays; zero is an empty slot.
unsafe impl Zeroable for IdGen {}

// `EngineMap::remap` views the IdGen array as plain u32s: no padding may sit between them.
const _: () = assert!(std::mem::size_of::<IdGen>() == 2 * WAYS * 4);

/// Arrays from this size up are fresh anonymous mappings (zero, untouched until written).
pub const MAP_BYTES: usize = 1 << 20;

/// A slot is named by a u32 (`bucket * WAYS + way`, and the engine maps store block slot + 1),
/// with `NONE` reserved: no table may have more buckets than this.
pub const MAX_BUCKETS: usize = (u32::MAX as usize - 1) / WAYS;

/// The check at the one place a table's size is chosen: past [`MAX_BUCKETS`] slot ids would wrap
/// around and name other blocks, so the core stops instead.
fn checked_buckets(nb: usize, what: &str) -> usize {
    assert!(
        nb <= MAX_BUCKETS,
        "{what}: {nb} buckets ({} slots) do not fit 32-bit slot ids (at most {MAX_BUCKETS} buckets)",
        nb as u128 * WAYS as u128
    );
    nb
}

/// A fixed-size array of zeroable `T`, zero-initialised without writing: large ones are fresh
/// anonymous mappings advised to use huge pages (a table's random probes then miss the TLB far
/// less often), small ones come from the allocator.
pub struct Buf<T: Zeroable> {
    ptr: *mut T,
    len: usize,
    mapped: bool,
}

// SAFETY: a Buf owns its memory exclusively, like a Vec.
unsafe impl<T: Zeroable + Send> Send for Buf<T> {}
unsafe impl<T: Zeroable + Sync> Sync for Buf<T> {}

impl<T: Zeroable> Buf<T> {
    pub fn zeroed(len: usize) -> Self {
        let layout = Layout::array::<T>(len).expect("table size overflows");
        let size = layout.size();
        if size == 0 {
            return Buf { ptr: std::ptr::NonNull::dangling().as_ptr(), len, mapped: false };
        }
        #[cfg(target_os = "linux")]
        if size >= MAP_BYTES && layout.align() <= 4096 {
            // SAFETY: an anonymous private mapping of `size` bytes, checked for failure; Linux
            // hands out zeroed pages, page-aligned (checked above against T's alignment), and
            // zero bytes are a valid T (the Zeroable bound).
            unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if p != libc::MAP_FAILED {
                    // Advice only: without transparent huge pages it fails and changes nothing.
                    libc::madvise(p, size, libc::MADV_HUGEPAGE);
                    return Buf { ptr: p as *mut T, len, mapped: true };
                }
            }
        }
        // SAFETY: non-zero layout; zero bytes are a valid T (the Zeroable bound).
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            handle_alloc_error(layout);
        }
        Buf { ptr: p as *mut T, len, mapped: false }
    }

    /// Whether the array is an anonymous mapping (else it came from the allocator).
    #[cfg(test)]
    pub fn mapped(&self) -> bool {
        self.mapped
    }
}

impl<T: Zeroable> Default for Buf<T> {
    fn default() -> Self {
        Buf::zeroed(0)
    }
}

impl<T: Zeroable> Drop for Buf<T> {
    fn drop(&mut self) {
        let layout = Layout::array::<T>(self.len).expect("table size overflows");
        if layout.size() == 0 {
            return;
        }
        // SAFETY: releases exactly what `zeroed` obtained, once.
        unsafe {
            #[cfg(target_os = "linux")]
            if self.mapped {
                libc::munmap(self.ptr as *mut libc::c_void, layout.size());
                return;
            }
            std::alloc::dealloc(self.ptr as *mut u8, layout);
        }
    }
}

impl<T: Zeroable> std::ops::Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialised (zero or written) Ts for the Buf's life.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Zeroable> std::ops::DerefMut for Buf<T> {
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
/// (The multiplier is forced odd, so `s1`'s lowest bit does not count: 127 bits of seed.)
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
fn buckets_for(keys: usize, max_load: f64, growth: f64, what: &str) -> usize {
    let n = (keys as f64 / (max_load / growth) / WAYS as f64) as usize + 1;
    checked_buckets(n.max(8), what)
}

impl BlockTable {
    /// The most blocks a table can be sized for (`presize`) within [`MAX_BUCKETS`].
    pub fn max_keys(max_load: f64) -> usize {
        ((MAX_BUCKETS - 1) as f64 * WAYS as f64 * (max_load / BLOCK_GROWTH)) as usize
    }
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
        self.nb = checked_buckets(nb, "block table");
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
        let nb = buckets_for(keys.max(live), self.max_load, BLOCK_GROWTH, "block table"); // checked before anything moves
        self.lo = Buf::default(); // the old arrays go first: the peak is one table, not two
        self.hi = Buf::default();
        self.meta = Buf::default();
        self.allocate(nb);
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
        self.nb = checked_buckets(nb, "engine map");
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
        let nb = buckets_for(want, self.max_load, ENGINE_GROWTH, "engine map"); // checked before anything moves
        self.h = Buf::default();
        self.ig = Buf::default();
        self.allocate(nb);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Distinct pseudo-random keys (splitmix64), the same for the same `seed`.
    fn keys(n: usize, seed: u64) -> Vec<(u64, u64)> {
        let mut x = seed;
        let mut next = move || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        (0..n).map(|_| (next(), next())).collect()
    }

    /// Insert like the core does: make room first.
    fn put(t: &mut BlockTable, lo: u64, hi: u64, scope1: u16, set: u32) -> u32 {
        if t.needs_rebuild(1) {
            let n = t.live + 1;
            t.rebuild(n);
        }
        t.insert(lo, hi, scope1, set)
    }

    /// `count` keys whose home bucket is `b`.
    fn keys_homed_at(t: &BlockTable, b: usize, count: usize) -> Vec<(u64, u64)> {
        (0u64..).map(|i| (i.wrapping_mul(0x2545_F491_4F6C_DD1D), !i)).filter(|&(lo, hi)| t.home(lo, hi) == b).take(count).collect()
    }

    #[test]
    fn a_small_buf_comes_zeroed_from_the_allocator() {
        let mut b: Buf<W64> = Buf::zeroed(100);
        assert!(!b.mapped());
        assert_eq!(b.len(), 100);
        assert!(b.iter().all(|w| w.0 == [0; WAYS]));
        b[99].0[7] = 5;
        assert_eq!(b[99].0[7], 5);
        let m: Buf<Meta> = Buf::zeroed(3);
        assert!(m.iter().all(|m| m.set == [0; WAYS] && m.scope == [0; WAYS] && m.gen == [0; WAYS]));
        let e: Buf<u32> = Buf::zeroed(0);
        assert!(e.is_empty());
    }

    #[test]
    fn a_large_buf_is_a_fresh_zeroed_mapping() {
        let n = 2 * MAP_BYTES / std::mem::size_of::<IdGen>() + 3; // past the threshold, not a whole page
        let mut b: Buf<IdGen> = Buf::zeroed(n);
        assert_eq!(b.mapped(), cfg!(target_os = "linux"));
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert!(b.iter().all(|x| x.id1 == [0; WAYS] && x.gen == [0; WAYS]));
        b[0].id1[0] = 1;
        b[n - 1].gen[WAYS - 1] = 7;
        assert_eq!((b[0].id1[0], b[n - 1].gen[WAYS - 1]), (1, 7));
        let just_under: Buf<u8> = Buf::zeroed(MAP_BYTES - 1);
        assert!(!just_under.mapped());
        let at: Buf<u8> = Buf::zeroed(MAP_BYTES);
        assert_eq!(at.mapped(), cfg!(target_os = "linux"));
        assert!(at.iter().all(|&x| x == 0));
    }

    #[test]
    fn inserted_keys_are_found_in_their_scope_and_deleted_ones_are_not() {
        let mut t = BlockTable::new(11, 22, 0.9);
        let ks = keys(5000, 1);
        let mut slots = Vec::new();
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            let s = put(&mut t, lo, hi, 1 + (i % 3) as u16, i as u32 + 1);
            slots.push(s);
        }
        // Slots moved in rebuilds: look every key up again.
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            let slot = t.find(lo, hi, 1 + (i % 3) as u16).expect("stored key");
            assert_eq!(t.set_of(slot), i as u32 + 1);
            assert_eq!(t.key_of(slot), (lo, hi));
            assert_eq!(t.find(lo, hi, 1 + ((i + 1) % 3) as u16), None, "another scope's key");
        }
        assert_eq!(t.live, ks.len());
        for (i, &(lo, hi)) in ks.iter().enumerate().step_by(2) {
            let slot = t.find(lo, hi, 1 + (i % 3) as u16).unwrap();
            let gen = t.gen_of(slot);
            t.delete(slot);
            assert!(!t.occupied(slot));
            assert_eq!(t.gen_of(slot), gen + 1, "an emptied slot's generation moves on");
        }
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            assert_eq!(t.find(lo, hi, 1 + (i % 3) as u16).is_some(), i % 2 == 1);
        }
        assert_eq!(t.live, ks.len() / 2);
        for &(lo, hi) in &keys(1000, 2) {
            assert_eq!(t.find(lo, hi, 1), None);
        }
    }

    #[test]
    fn a_full_bucket_is_flagged_and_searches_continue_past_it() {
        let mut t = BlockTable::new(3, 4, 0.9);
        assert_eq!(t.nb, 8);
        for b in [2, t.nb - 1] {
            // The last bucket's spill wraps around to bucket 0.
            let crowd = keys_homed_at(&t, b, WAYS + 3);
            let absent = keys_homed_at(&t, b, WAYS + 4)[WAYS + 3];
            let slots: Vec<u32> = crowd.iter().map(|&(lo, hi)| t.insert(lo, hi, 1, 9)).collect();
            assert!(t.overflow[b], "bucket {b} turned keys away");
            assert!(slots[..WAYS].iter().all(|&s| s as usize / WAYS == b));
            assert!(slots[WAYS..].iter().all(|&s| s as usize / WAYS == (b + 1) % t.nb));
            for (&(lo, hi), &s) in crowd.iter().zip(&slots) {
                assert_eq!(t.find(lo, hi, 1), Some(s));
            }
            assert_eq!(t.find(absent.0, absent.1, 1), None);
            // Emptying a slot in the home bucket leaves the flag: the spilled keys stay found.
            t.delete(slots[0]);
            assert!(t.overflow[b]);
            for (&(lo, hi), &s) in crowd.iter().zip(&slots).skip(1) {
                assert_eq!(t.find(lo, hi, 1), Some(s));
            }
            // The freed slot takes the next key homed there.
            assert_eq!(t.insert(absent.0, absent.1, 1, 9), slots[0]);
        }
        // A bucket that never turned a key away ends the search.
        let quiet = (0..t.nb).find(|&b| !t.overflow[b] && !t.overflow[(b + t.nb - 1) % t.nb]).unwrap();
        assert!(t.meta[quiet].scope.iter().all(|&s| s == 0));
        let (lo, hi) = keys_homed_at(&t, quiet, 1)[0];
        assert_eq!(t.find(lo, hi, 1), None);
    }

    #[test]
    fn rebuilds_keep_every_key_and_say_where_each_slot_went() {
        let mut t = BlockTable::new(5, 6, 0.9);
        let ks = keys(3000, 3);
        let mut slot_of: HashMap<(u64, u64), u32> = HashMap::new();
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            slot_of.insert((lo, hi), t.insert(lo, hi, 1, i as u32));
            if t.needs_rebuild(1) {
                let before = t.capacity();
                let gens: Vec<u32> = (0..before as u32).map(|s| t.gen_of(s)).collect();
                let (map, old_gen) = t.rebuild(t.live + 1);
                assert!(!t.needs_rebuild(1), "room again");
                assert_eq!(map.len(), before);
                assert!(old_gen.iter().zip(&gens).all(|(&a, &b)| a as u32 == b));
                for s in slot_of.values_mut() {
                    assert_ne!(map[*s as usize], NONE);
                    *s = map[*s as usize];
                }
            }
        }
        assert!(t.rebuilds > 0);
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            let s = slot_of[&(lo, hi)];
            assert_eq!(t.find(lo, hi, 1), Some(s));
            assert_eq!((t.key_of(s), t.set_of(s), t.gen_of(s)), ((lo, hi), i as u32, 0));
        }
        // Shrink: drop nine keys in ten, rebuild for the rest.
        for &(lo, hi) in ks.iter().filter(|k| k.0 % 10 != 0) {
            t.delete(t.find(lo, hi, 1).unwrap());
        }
        assert!(t.should_shrink());
        let (cap, live) = (t.capacity(), t.live);
        let (map, _) = t.rebuild(live);
        assert!(t.capacity() < cap && t.live == live && !t.should_shrink());
        assert_eq!(map.iter().filter(|&&s| s != NONE).count(), live);
        for (i, &(lo, hi)) in ks.iter().enumerate() {
            let found = t.find(lo, hi, 1);
            assert_eq!(found.is_some(), lo % 10 == 0);
            if let Some(s) = found {
                assert_eq!(t.set_of(s), i as u32);
            }
        }
    }

    #[test]
    fn a_rebuild_clears_the_overflow_flags() {
        let mut t = BlockTable::new(7, 8, 0.9);
        for &(lo, hi) in &keys_homed_at(&t, 4, WAYS + 1) {
            t.insert(lo, hi, 1, 1);
        }
        assert_eq!(t.n_overflow, 1);
        t.rebuild(10_000);
        assert_eq!(t.overflow.iter().filter(|&&f| f).count(), t.n_overflow);
        assert_eq!(t.n_overflow, 0, "nine keys spread over a large table");
        assert_eq!(t.live, WAYS + 1);
    }

    #[test]
    fn the_seed_chooses_the_buckets() {
        let mk = |s0, s1| {
            let mut t = BlockTable::new(s0, s1, 0.9);
            t.rebuild(100_000);
            t
        };
        let (a, same) = (mk(1, 2), mk(1, 2));
        let ks = keys(1000, 4);
        assert!(ks.iter().all(|&(lo, hi)| a.home(lo, hi) == same.home(lo, hi)));
        // Either seed word moves the keys (the second's lowest bit excepted: see hash128).
        for other in [mk(3, 2), mk(1, 6), mk(0xDEAD_BEEF, 0x1234_5678_9ABC)] {
            let moved = ks.iter().filter(|&&(lo, hi)| a.home(lo, hi) != other.home(lo, hi)).count();
            assert!(moved > 990, "another seed, other buckets ({moved} of 1000 moved)");
        }
        // Keys a publisher could pick in a row (counters, zero high words) spread evenly.
        let mut per = vec![0u32; a.nb];
        for i in 0..(a.nb as u64 * 4) {
            per[a.home(i, 0)] += 1;
        }
        assert!(*per.iter().max().unwrap() <= 24, "sequential keys piled up: {}", per.iter().max().unwrap());
        let (mut e1, mut e2) = (EngineMap::new(1, 2, 0.9), EngineMap::new(9, 2, 0.9));
        e1.rebuild(100_000, |_, _| true);
        e2.rebuild(100_000, |_, _| true);
        let differ = (0..1000u64).filter(|&h| e1.home(h) != e2.home(h)).count();
        assert!(differ > 990, "engine maps' buckets follow their seed ({differ} of 1000 moved)");
    }

    #[test]
    fn the_largest_presize_fits_and_one_more_does_not() {
        let most = BlockTable::max_keys(0.9);
        assert!(buckets_for(most, 0.9, BLOCK_GROWTH, "t") <= MAX_BUCKETS);
        assert!(std::panic::catch_unwind(|| buckets_for(most + most / 100, 0.9, BLOCK_GROWTH, "t")).is_err());
    }

    #[test]
    #[should_panic(expected = "do not fit 32-bit slot ids")]
    fn a_table_past_32_bit_slot_ids_is_refused_before_it_is_built() {
        buckets_for(usize::MAX / 4, 0.9, 1.5, "block table");
    }

    #[test]
    fn the_largest_table_still_names_its_last_slot() {
        assert_eq!(checked_buckets(MAX_BUCKETS, "t"), MAX_BUCKETS);
        let last = (MAX_BUCKETS * WAYS - 1) as u64;
        assert!(u32::try_from(last).is_ok_and(|s| s != NONE), "the last slot is not NONE");
        assert!(u32::try_from(last + 1).is_ok(), "slot + 1 fits the engine maps' u32");
    }

    #[test]
    fn engine_maps_insert_find_delete_and_rebuild_keeping_what_is_asked() {
        let mut m = EngineMap::new(1, 2, 0.9);
        let n = 2000u64;
        let mut grew = 0;
        for h in 0..n {
            grew += m.insert(h * 7919, h as u32, (h % 5) as u32, None) as u32;
        }
        assert!(grew > 5 && m.capacity() as f64 * 0.9 >= m.live as f64);
        assert_eq!(m.live, n as usize);
        for h in 0..n {
            let s = m.find(h * 7919).expect("inserted");
            assert_eq!(m.get(s), (h as u32, (h % 5) as u32));
            assert_eq!(m.hash_at(s), h * 7919);
        }
        assert_eq!(m.find(1), None);
        for h in (0..n).step_by(3) {
            let s = m.find(h * 7919).unwrap();
            m.delete(s);
        }
        let left = m.live;
        assert_eq!(m.slots().count(), left);
        m.rebuild(left, |id, _| id % 2 == 0); // keep even block ids only
        for h in 0..n {
            assert_eq!(m.find(h * 7919).is_some(), h % 3 != 0 && h % 2 == 0);
        }
        assert_eq!(m.slots().count(), m.live);
    }

    #[test]
    fn engine_entries_follow_their_blocks_through_a_block_table_rebuild() {
        let mut t = BlockTable::new(1, 1, 0.9);
        let ks = keys(50, 5);
        let slots: Vec<u32> = ks.iter().map(|&(lo, hi)| t.insert(lo, hi, 1, 1)).collect();
        let mut m = EngineMap::new(3, 3, 0.9);
        for (i, &s) in slots.iter().enumerate() {
            m.insert(1000 + i as u64, s, t.gen_of(s), None);
        }
        // Block 0 leaves; block 1's entry has a stale generation.
        t.delete(slots[0]);
        m.put(m.find(1001).unwrap(), slots[1], t.gen_of(slots[1]) + 1);
        let (map, old_gen) = t.rebuild(5000);
        m.remap(&map, &old_gen);
        assert_eq!(m.find(1000), None);
        assert_eq!(m.find(1001), None);
        for (i, &(lo, hi)) in ks.iter().enumerate().skip(2) {
            let (id, gen) = m.get(m.find(1000 + i as u64).unwrap());
            assert_eq!((Some(id), gen), (t.find(lo, hi, 1), 0));
        }
        assert_eq!(m.live, 48);
    }
}
