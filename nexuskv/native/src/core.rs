//! The index core: which canonical blocks (scope, 128-bit key) are held at which locations, and
//! every publisher's engine-hash map. No Python here; `lib.rs` wraps it.
//!
//! * **Blocks** live in a [`BlockTable`] under their key mixed with their scope's salt (so a key
//!   presented in a foreign scope probes an unrelated bucket, exactly like a key that exists
//!   nowhere) and their scope id (checked on a full-key match). A block is named by its slot
//!   (every reference is remapped when the table is rebuilt) and the slot's generation, which
//!   changes when the slot is emptied. A block exists while its location set is not empty.
//! * **Engine maps**, one per publisher: engine hash -> (block id, generation). An entry is
//!   *valid* while its block still has that generation and the publisher holds the block in some
//!   location; an invalid entry is treated as absent and removed when met or when the map is
//!   rebuilt. So "a publisher's map entry lives while the publisher holds the block" holds with
//!   no reverse map from blocks to hashes.
//! * **Members**: per location, the ids of the blocks added there (a superset of those still
//!   there, compacted when it doubles), so a clear visits what it removes, not the index.

use crate::sets::Sets;
use crate::tables::{prefetch, BlockTable, EngineMap, MAX_SCOPES, NONE};

pub const MAX_LOAD: f64 = 0.9;
const MAX_BLOCKS_PER_CALL: usize = 1 << 16; // past it a store may rebuild mid-call (no slot is held across)
const PREFETCH_AHEAD: usize = 12;

/// The block table; a block is named by its slot.
pub struct Blocks {
    pub t: BlockTable,
}

impl Blocks {
    #[inline(always)]
    pub fn alive(&self, id: u32) -> bool {
        (id as usize) < self.t.capacity() && self.t.occupied(id)
    }

    #[inline(always)]
    pub fn set(&self, id: u32) -> u32 {
        self.t.set_of(id)
    }
}

pub struct Publisher {
    pub engine: EngineMap,
    pub locs: Vec<u32>,
    stale: usize, // entries probably made invalid since the last rebuild
}

pub struct Scope {
    pub salt_hi: u64,
    pub salt_lo: u64,
    pub blocks: u64,
    pub live: bool,
    pub serial: u64, // unique to this scope's life: an id reused later gets another one
}

#[derive(Default, Clone, Copy)]
pub struct Forgot {
    pub memberships: u64,
    pub blocks: u64,
}

pub struct Core {
    pub blocks: Blocks,
    pub sets: Sets,
    pub loc_pub: Vec<u32>,
    members: Vec<Vec<u32>>,
    pub loc_count: Vec<u64>,
    pub pubs: Vec<Publisher>,
    pub scopes: Vec<Scope>,
    free_scopes: Vec<u32>,
    dirty_scopes: Vec<u32>,
    pub memberships: u64,
    cursor: usize,
    seed: [u64; 4],
    serials: u64,
}

/// A lookup's working arrays, one per thread: lookups only read the core, so several run at once.
#[derive(Default)]
struct Scratch {
    lo: Vec<u64>,
    hi: Vec<u64>,
    home: Vec<u32>,
    set: Vec<u32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Is the engine entry (id, gen) of publisher `publ` valid?
#[inline(always)]
fn valid(blocks: &Blocks, sets: &Sets, loc_pub: &[u32], publ: u32, id: u32, gen: u32) -> bool {
    blocks.alive(id) && blocks.t.gen_of(id) == gen && sets.holds_pub(blocks.t.set_of(id), publ, loc_pub)
}

/// Drop the member list entries of `loc` that no longer hold it (and duplicates).
fn compact(m: &mut Vec<u32>, loc: u32, blocks: &Blocks, sets: &Sets) {
    m.retain(|&id| blocks.alive(id) && sets.get(blocks.set(id)).binary_search(&loc).is_ok());
    m.sort_unstable();
    m.dedup();
    m.shrink_to(m.len() + m.len() / 4 + 16);
}

enum Entry {
    Valid(u32, u32), // (engine slot, block id)
    Stale(u32),
    Absent,
}

/// A run of query blocks `[start, end)` at one location.
pub type Run = (u32, u32);

/// A location and the (scope id, (hi, lo) key) of every block it holds, in two columns.
pub type LocationFacts = (u32, Vec<u32>, Vec<(u64, u64)>);

impl Core {
    pub fn new(seed: [u64; 4]) -> Self {
        Core {
            blocks: Blocks { t: BlockTable::new(seed[0], seed[1], MAX_LOAD) },
            sets: Sets::new(),
            loc_pub: Vec::new(),
            members: Vec::new(),
            loc_count: Vec::new(),
            pubs: Vec::new(),
            scopes: Vec::new(),
            free_scopes: Vec::new(),
            dirty_scopes: Vec::new(),
            memberships: 0,
            cursor: 0,
            seed,
            serials: 0,
        }
    }

    // -- argument checks (the wrapper runs them under the same lock as the call) ----------------

    pub fn check_pub(&self, publ: u32) -> Result<(), String> {
        if (publ as usize) < self.pubs.len() {
            Ok(())
        } else {
            Err(format!("unknown publisher id {publ}"))
        }
    }

    pub fn check_loc(&self, publ: u32, loc: u32) -> Result<(), String> {
        self.check_pub(publ)?;
        if (loc as usize) < self.loc_pub.len() && self.loc_pub[loc as usize] == publ {
            Ok(())
        } else {
            Err(format!("location {loc} is not publisher {publ}'s"))
        }
    }

    pub fn check_scope(&self, sid: u32) -> Result<(), String> {
        if self.scope_live(sid) {
            Ok(())
        } else {
            Err(format!("unknown scope id {sid}"))
        }
    }

    pub fn scope_live(&self, sid: u32) -> bool {
        (sid as usize) < self.scopes.len() && self.scopes[sid as usize].live
    }

    fn new_engine(&self, publ: u32) -> EngineMap {
        EngineMap::new(self.seed[2] ^ (publ as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15), self.seed[3], MAX_LOAD)
    }

    // -- registries ---------------------------------------------------------------------------

    pub fn add_publisher(&mut self) -> u32 {
        let p = self.pubs.len() as u32;
        let engine = self.new_engine(p);
        self.pubs.push(Publisher { engine, locs: Vec::new(), stale: 0 });
        p
    }

    pub fn add_location(&mut self, publ: u32) -> u32 {
        assert!((publ as usize) < self.pubs.len(), "unknown publisher");
        let loc = self.loc_pub.len() as u32;
        self.loc_pub.push(publ);
        self.members.push(Vec::new());
        self.loc_count.push(0);
        self.pubs[publ as usize].locs.push(loc);
        loc
    }

    /// A new scope: (id, serial); None when `MAX_SCOPES` are live. The serial tells this scope
    /// from any later one that reuses its id.
    pub fn add_scope(&mut self, salt_hi: u64, salt_lo: u64) -> Option<(u32, u64)> {
        if self.free_scopes.is_empty() && self.scopes.len() >= MAX_SCOPES {
            return None;
        }
        self.serials += 1;
        let serial = self.serials;
        let sc = Scope { salt_hi, salt_lo, blocks: 0, live: true, serial };
        let sid = match self.free_scopes.pop() {
            Some(s) => {
                self.scopes[s as usize] = sc;
                s
            }
            None => {
                self.scopes.push(sc);
                (self.scopes.len() - 1) as u32
            }
        };
        self.dirty_scopes.push(sid);
        Some((sid, serial))
    }

    /// Scopes that have no block now (and were new or lost blocks since the last call).
    pub fn take_empty_scopes(&mut self) -> Vec<u32> {
        let mut out: Vec<u32> = std::mem::take(&mut self.dirty_scopes)
            .into_iter()
            .filter(|&s| self.scopes[s as usize].live && self.scopes[s as usize].blocks == 0)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    pub fn release_scope(&mut self, sid: u32) -> bool {
        let sc = &mut self.scopes[sid as usize];
        if !sc.live || sc.blocks != 0 {
            return false;
        }
        sc.live = false;
        self.free_scopes.push(sid);
        true
    }

    pub fn live_scopes(&self) -> usize {
        self.scopes.len() - self.free_scopes.len()
    }

    // -- block bookkeeping ----------------------------------------------------------------------

    /// Size the block table for `blocks` blocks now (it still grows past them).
    pub fn presize(&mut self, blocks: usize) {
        // Kept as the table's floor: the shrink rule (live * 8 < capacity) would otherwise undo
        // the sizing at the first store into the still nearly empty table.
        self.blocks.t.floor = self.blocks.t.floor.max(blocks);
        if blocks > self.blocks.t.live && self.blocks.t.needs_rebuild(blocks - self.blocks.t.live) {
            self.rebuild_blocks(blocks);
        }
    }

    /// Make room for `extra` new blocks now, so no slot moves until they are in.
    fn reserve(&mut self, extra: usize) {
        if self.blocks.t.needs_rebuild(extra) {
            let keys = self.blocks.t.live + extra;
            self.rebuild_blocks(keys);
        }
    }

    /// Rebuild the block table and point every reference (engine entries, member lists) at the
    /// blocks' new slots.
    fn rebuild_blocks(&mut self, keys: usize) {
        let (map, old_gen) = self.blocks.t.rebuild(keys);
        for p in &mut self.pubs {
            p.engine.remap(&map, &old_gen);
            p.stale = 0;
        }
        // Member lists are rebuilt from the new table in slot order (a sequential pass, and
        // compacted as a side effect) rather than remapped entry by entry.
        let mut lists: Vec<Vec<u32>> = self
            .loc_count
            .iter()
            .map(|&c| Vec::with_capacity(c as usize + c as usize / 4 + 16))
            .collect();
        let t = &self.blocks.t;
        for slot in 0..t.capacity() as u32 {
            if t.occupied(slot) {
                for &loc in self.sets.get(t.set_of(slot)) {
                    lists[loc as usize].push(slot);
                }
            }
        }
        self.members = lists;
    }

    fn find_or_insert(&mut self, lo: u64, hi: u64, sid: u32) -> u32 {
        if let Some(slot) = self.blocks.t.find(lo, hi, (sid + 1) as u16) {
            return slot;
        }
        self.reserve(1);
        self.scopes[sid as usize].blocks += 1;
        self.blocks.t.insert(lo, hi, (sid + 1) as u16, 0)
    }

    fn free_block(&mut self, id: u32) {
        let sid = self.blocks.t.scope1_of(id) - 1;
        self.blocks.t.delete(id);
        let sc = &mut self.scopes[sid as usize];
        sc.blocks -= 1;
        if sc.blocks == 0 {
            self.dirty_scopes.push(sid);
        }
    }

    /// Point block `id` at set `new`, keeping counts, member lists and the block's life.
    fn set_block(&mut self, id: u32, new: u32) {
        let old = self.blocks.t.set_of(id);
        if old == new {
            return;
        }
        self.sets.retain(new, 1);
        self.sets.retain(old, -1);
        self.blocks.t.put_set(id, new); // first: a compaction below must see the new set
        {
            let (sets, blocks) = (&self.sets, &self.blocks);
            let (members, loc_count) = (&mut self.members, &mut self.loc_count);
            let (a, b) = (sets.get(old), sets.get(new));
            let (mut i, mut j) = (0, 0);
            while i < a.len() || j < b.len() {
                if j == b.len() || (i < a.len() && a[i] < b[j]) {
                    loc_count[a[i] as usize] -= 1;
                    i += 1;
                } else if i == a.len() || b[j] < a[i] {
                    let loc = b[j] as usize;
                    loc_count[loc] += 1;
                    let m = &mut members[loc];
                    if m.len() == m.capacity() {
                        m.reserve_exact((m.len() / 2).max(16));
                    }
                    m.push(id);
                    if m.len() > 2 * loc_count[loc] as usize + 64 {
                        compact(m, loc as u32, blocks, sets);
                    }
                    j += 1;
                } else {
                    i += 1;
                    j += 1;
                }
            }
        }
        self.memberships = self.memberships + self.sets.get(new).len() as u64 - self.sets.get(old).len() as u64;
        if new == 0 {
            self.free_block(id);
        }
    }

    fn entry(&self, publ: u32, h: u64) -> Entry {
        let map = &self.pubs[publ as usize].engine;
        match map.find(h) {
            None => Entry::Absent,
            Some(es) => {
                let (id, gen) = map.get(es);
                if valid(&self.blocks, &self.sets, &self.loc_pub, publ, id, gen) {
                    Entry::Valid(es, id)
                } else {
                    Entry::Stale(es)
                }
            }
        }
    }

    /// Before handling hash `i`: fetch the engine bucket of hash `i + 2d` and, through the entry
    /// of hash `i + d` (its bucket fetched a round earlier), its block's lines.
    #[inline(always)]
    fn prefetch_entries(&self, publ: u32, hashes: &[u64], i: usize) {
        let map = &self.pubs[publ as usize].engine;
        if let Some(&h) = hashes.get(i + 2 * PREFETCH_AHEAD) {
            map.prefetch_home(h);
        }
        if let Some(&h) = hashes.get(i + PREFETCH_AHEAD) {
            if let Some(es) = map.find(h) {
                let (id, _gen) = map.get(es);
                if (id as usize) < self.blocks.t.capacity() {
                    self.blocks.t.prefetch_bucket(id as usize / crate::tables::WAYS);
                }
            }
        }
    }

    fn engine_insert(&mut self, publ: u32, h: u64, id: u32) {
        let gen = self.blocks.t.gen_of(id);
        let (blocks, sets, loc_pub) = (&self.blocks, &self.sets, &self.loc_pub);
        let p = &mut self.pubs[publ as usize];
        // Validating every entry costs a block-table read each: only when many may be stale.
        if p.stale > p.engine.live / 4 {
            let mut keep = |i: u32, g: u32| valid(blocks, sets, loc_pub, publ, i, g);
            if p.engine.insert(h, id, gen, Some(&mut keep)) {
                p.stale = 0;
            }
        } else {
            p.engine.insert(h, id, gen, None);
        }
    }

    /// Remove every location of `publ` from block `id`.
    fn drop_pub(&mut self, id: u32, publ: u32) {
        let s = self.blocks.set(id);
        let t = self.sets.without_pub(s, publ, &self.loc_pub);
        self.set_block(id, t);
        self.pubs[publ as usize].stale += 1;
    }

    fn tidy(&mut self, publ: Option<u32>) {
        self.sets.flush();
        if let Some(p) = publ {
            let (blocks, sets, loc_pub) = (&self.blocks, &self.sets, &self.loc_pub);
            let pb = &mut self.pubs[p as usize];
            if pb.stale > pb.engine.live / 2 + 64 || pb.engine.should_shrink() {
                let live = pb.engine.live;
                pb.engine.rebuild(live, |i, g| valid(blocks, sets, loc_pub, p, i, g));
                pb.stale = 0;
            }
        }
        if self.blocks.t.should_shrink() || self.blocks.t.worn {
            let keys = self.blocks.t.live.max(self.blocks.t.floor);
            self.rebuild_blocks(keys);
        }
    }

    // -- events ---------------------------------------------------------------------------------

    /// Blocks with canonical `keys` ((hi, lo) words) in scope `sid`, stored by `publ` at `loc`
    /// under engine `hashes`, in order: a hash that named another block moves to this one, and
    /// the other block leaves every location of this publisher.
    pub fn store(&mut self, publ: u32, loc: u32, sid: u32, keys: &[(u64, u64)], hashes: &[u64]) {
        let (shi, slo) = (self.scopes[sid as usize].salt_hi, self.scopes[sid as usize].salt_lo);
        let mut cache = (NONE, NONE);
        self.reserve(keys.len().min(MAX_BLOCKS_PER_CALL));
        for (i, (&(hi, lo), &h)) in keys.iter().zip(hashes).enumerate() {
            if let (Some(&(phi, plo)), Some(&ph)) = (keys.get(i + PREFETCH_AHEAD), hashes.get(i + PREFETCH_AHEAD)) {
                let t = &self.blocks.t;
                t.prefetch_bucket(t.home(plo ^ slo, phi ^ shi));
                self.pubs[publ as usize].engine.prefetch_home(ph);
            }
            let id = self.find_or_insert(lo ^ slo, hi ^ shi, sid);
            match self.entry(publ, h) {
                Entry::Valid(_, old) if old == id => {}
                Entry::Valid(es, old) => {
                    self.drop_pub(old, publ);
                    let gen = self.blocks.t.gen_of(id);
                    self.pubs[publ as usize].engine.put(es, id, gen);
                }
                Entry::Stale(es) => {
                    let gen = self.blocks.t.gen_of(id);
                    self.pubs[publ as usize].engine.put(es, id, gen);
                }
                Entry::Absent => self.engine_insert(publ, h, id),
            }
            let s = self.blocks.set(id);
            let t = if s == cache.0 {
                cache.1
            } else {
                let t = self.sets.with_loc(s, loc);
                cache = (s, t);
                t
            };
            self.set_block(id, t);
        }
        self.tidy(Some(publ));
    }

    /// Known blocks (by engine hash) now also at `loc`; returns how many hashes were known.
    pub fn store_tier(&mut self, publ: u32, loc: u32, hashes: &[u64]) -> usize {
        let mut known = 0;
        let mut cache = (NONE, NONE);
        for (i, &h) in hashes.iter().enumerate() {
            self.prefetch_entries(publ, hashes, i);
            match self.entry(publ, h) {
                Entry::Valid(_, id) => {
                    known += 1;
                    let s = self.blocks.set(id);
                    let t = if s == cache.0 {
                        cache.1
                    } else {
                        let t = self.sets.with_loc(s, loc);
                        cache = (s, t);
                        t
                    };
                    self.set_block(id, t);
                }
                Entry::Stale(es) => self.pubs[publ as usize].engine.delete(es),
                Entry::Absent => {}
            }
        }
        self.tidy(Some(publ));
        known
    }

    /// Engine `hashes` gone from `loc` (None: a location the publisher never had); returns how
    /// many hashes were known. A hash whose block the publisher no longer holds anywhere leaves
    /// the map.
    pub fn remove(&mut self, publ: u32, loc: Option<u32>, hashes: &[u64]) -> usize {
        let mut known = 0;
        let mut cache = (NONE, NONE);
        for (i, &h) in hashes.iter().enumerate() {
            self.prefetch_entries(publ, hashes, i);
            match self.entry(publ, h) {
                Entry::Valid(es, id) => {
                    known += 1;
                    if let Some(l) = loc {
                        let s = self.blocks.set(id);
                        let t = if s == cache.0 {
                            cache.1
                        } else {
                            let t = self.sets.without_loc(s, l);
                            cache = (s, t);
                            t
                        };
                        self.set_block(id, t);
                        if !self.blocks.alive(id) || !self.sets.holds_pub(self.blocks.set(id), publ, &self.loc_pub) {
                            self.pubs[publ as usize].engine.delete(es); // (other hashes of it, if any, are stale now)
                        }
                    }
                }
                Entry::Stale(es) => self.pubs[publ as usize].engine.delete(es),
                Entry::Absent => {}
            }
        }
        self.tidy(Some(publ));
        known
    }

    /// Everything of `publ` at `locs` is gone; `all`: the publisher holds nothing anywhere now.
    /// Visits the member lists of `locs` only.
    pub fn clear(&mut self, publ: u32, locs: &[u32], all: bool) {
        for &loc in locs {
            let list = std::mem::take(&mut self.members[loc as usize]);
            let mut cache = (NONE, NONE);
            for id in list {
                if !self.blocks.alive(id) {
                    continue;
                }
                let s = self.blocks.set(id);
                if self.sets.get(s).binary_search(&loc).is_err() {
                    continue;
                }
                let t = if s == cache.0 {
                    cache.1
                } else {
                    let t = self.sets.without_loc(s, loc);
                    cache = (s, t);
                    t
                };
                self.set_block(id, t);
                self.pubs[publ as usize].stale += 1;
            }
            debug_assert_eq!(self.loc_count[loc as usize], 0);
            self.members[loc as usize] = Vec::new();
        }
        if all {
            let engine = self.new_engine(publ);
            let p = &mut self.pubs[publ as usize];
            p.engine = engine;
            p.stale = 0;
        }
        self.tidy(Some(publ));
    }

    /// The canonical key (hi, lo) of the block that `publ`'s engine hash `h` names.
    pub fn parent_key(&self, publ: u32, h: u64) -> Option<(u64, u64)> {
        match self.entry(publ, h) {
            Entry::Valid(_, id) => Some(self.key_of_id(id)),
            _ => None,
        }
    }

    fn key_of_id(&self, id: u32) -> (u64, u64) {
        let (lo, hi) = self.blocks.t.key_of(id);
        let sc = &self.scopes[(self.blocks.t.scope1_of(id) - 1) as usize];
        (hi ^ sc.salt_hi, lo ^ sc.salt_lo)
    }

    fn drop_block(&mut self, id: u32, got: &mut Forgot) {
        let s = self.blocks.set(id);
        let n = self.sets.get(s).len();
        for i in 0..n {
            let p = self.loc_pub[self.sets.get(s)[i] as usize];
            self.pubs[p as usize].stale += 1;
        }
        got.memberships += n as u64;
        got.blocks += 1;
        self.set_block(id, 0);
    }

    /// Forget whole blocks from a rotating cursor (slot order is hash order: a uniform sample)
    /// until `excess` memberships are gone.
    pub fn forget(&mut self, excess: u64) -> Forgot {
        let mut got = Forgot::default();
        let cap = self.blocks.t.capacity();
        let mut i = self.cursor % cap;
        let mut seen = 0;
        while got.memberships < excess && seen < cap && self.blocks.t.live > 0 {
            let slot = i as u32;
            if self.blocks.t.scope1_of(slot) != 0 {
                self.drop_block(slot, &mut got);
            }
            i = (i + 1) % cap;
            seen += 1;
        }
        self.cursor = i;
        for p in 0..self.pubs.len() {
            self.tidy(Some(p as u32));
        }
        got
    }

    /// Forget every block of the scopes `sids` (one pass over the block table).
    pub fn forget_scopes(&mut self, sids: &[u32]) -> Forgot {
        let mut got = Forgot::default();
        let mut mark = vec![false; self.scopes.len() + 1];
        for &s in sids {
            if (s as usize) < self.scopes.len() {
                mark[s as usize + 1] = true;
            }
        }
        for slot in 0..self.blocks.t.capacity() as u32 {
            let s1 = self.blocks.t.scope1_of(slot);
            if s1 != 0 && mark[s1 as usize] {
                self.drop_block(slot, &mut got);
            }
        }
        for p in 0..self.pubs.len() {
            self.tidy(Some(p as u32));
        }
        got
    }

    // -- lookups --------------------------------------------------------------------------------

    /// Per location holding any of `keys` ((hi, lo) words, in scope `sid`): its runs of present
    /// blocks, by location. Reads the core only (its working arrays are per thread).
    pub fn lookup(&self, sid: u32, keys: &[(u64, u64)]) -> Vec<(u32, Vec<Run>)> {
        SCRATCH.with(|q| self.lookup_with(&mut q.borrow_mut(), sid, keys))
    }

    fn lookup_with(&self, q: &mut Scratch, sid: u32, keys: &[(u64, u64)]) -> Vec<(u32, Vec<Run>)> {
        let sc = &self.scopes[sid as usize];
        let (shi, slo, s1) = (sc.salt_hi, sc.salt_lo, (sid + 1) as u16);
        let t = &self.blocks.t;
        let n = keys.len();
        q.lo.clear();
        q.hi.clear();
        q.home.clear();
        q.set.clear();
        for &(hi, lo) in keys {
            let (lo, hi) = (lo ^ slo, hi ^ shi);
            q.lo.push(lo);
            q.hi.push(hi);
            q.home.push(t.home(lo, hi) as u32);
        }
        for i in 0..n.min(PREFETCH_AHEAD) {
            prefetch(&t.lo[q.home[i] as usize]);
        }
        for i in 0..n {
            if i + PREFETCH_AHEAD < n {
                let b = q.home[i + PREFETCH_AHEAD] as usize;
                prefetch(&t.lo[b]);
                prefetch(&t.hi[b]);
                prefetch(&t.meta[b]);
            }
            let set = match t.probe_from(q.home[i] as usize, q.lo[i], q.hi[i], s1) {
                Some(slot) => t.set_of(slot),
                None => 0,
            };
            q.set.push(set);
        }
        let mut acc: Vec<(u32, Vec<Run>)> = Vec::new();
        let present = &q.set;
        let mut i = 0;
        while i < n {
            let s = present[i];
            let mut j = i + 1;
            while j < n && present[j] == s {
                j += 1;
            }
            if s != 0 {
                for &loc in self.sets.get(s) {
                    match acc.iter_mut().find(|(l, _)| *l == loc) {
                        Some((_, runs)) => {
                            let last = runs.last_mut().expect("a location has a run");
                            if last.1 == i as u32 {
                                last.1 = j as u32;
                            } else {
                                runs.push((i as u32, j as u32));
                            }
                        }
                        None => acc.push((loc, vec![(i as u32, j as u32)])),
                    }
                }
            }
            i = j;
        }
        acc.sort_unstable_by_key(|(l, _)| *l);
        acc
    }

    // -- inspection and checkpoints -------------------------------------------------------------

    /// Per location: (scope id, key) of every block held there.
    pub fn facts(&self) -> Vec<LocationFacts> {
        let mut out = Vec::new();
        for loc in 0..self.members.len() {
            if self.loc_count[loc] == 0 {
                continue;
            }
            let mut ids: Vec<u32> = self.members[loc]
                .iter()
                .copied()
                .filter(|&id| {
                    self.blocks.alive(id) && self.sets.get(self.blocks.set(id)).binary_search(&(loc as u32)).is_ok()
                })
                .collect();
            ids.sort_unstable();
            ids.dedup();
            let scopes = ids.iter().map(|&id| self.blocks.t.scope1_of(id) - 1).collect();
            let keys = ids.iter().map(|&id| self.key_of_id(id)).collect();
            out.push((loc as u32, scopes, keys));
        }
        out
    }

    /// A publisher's valid engine entries: hashes, their blocks' keys and scopes, and for each
    /// of its locations the rows whose block is held there.
    #[allow(clippy::type_complexity)]
    pub fn export(&self, publ: u32) -> (Vec<u64>, Vec<(u64, u64)>, Vec<u32>, Vec<(u32, Vec<u32>)>) {
        let p = &self.pubs[publ as usize];
        let (mut hashes, mut keys, mut scopes, mut sets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for es in p.engine.slots() {
            let (id, gen) = p.engine.get(es);
            if !valid(&self.blocks, &self.sets, &self.loc_pub, publ, id, gen) {
                continue;
            }
            hashes.push(p.engine.hash_at(es));
            keys.push(self.key_of_id(id));
            scopes.push(self.blocks.t.scope1_of(id) - 1);
            sets.push(self.blocks.set(id));
        }
        let held = p
            .locs
            .iter()
            .map(|&loc| {
                let rows = (0..sets.len() as u32)
                    .filter(|&r| self.sets.get(sets[r as usize]).binary_search(&loc).is_ok())
                    .collect();
                (loc, rows)
            })
            .collect();
        (hashes, keys, scopes, held)
    }

    /// Load exported rows for `publ` (whose state the caller cleared first). A row no location
    /// holds is not part of the publisher's state and is skipped. Rows are applied one at a time
    /// (a block table rebuild may move slots between rows; none is held across).
    pub fn restore(&mut self, publ: u32, hashes: &[u64], keys: &[(u64, u64)], scopes: &[u32], held: &[(u32, Vec<u32>)]) {
        let mut pairs: Vec<(u32, u32)> = held.iter().flat_map(|(loc, rows)| rows.iter().map(move |&r| (r, *loc))).collect();
        pairs.sort_unstable();
        self.reserve(hashes.len().min(MAX_BLOCKS_PER_CALL));
        let mut k = 0;
        while k < pairs.len() {
            let r = pairs[k].0 as usize;
            let (h, (hi, lo), sid) = (hashes[r], keys[r], scopes[r]);
            let sc = &self.scopes[sid as usize];
            let id = self.find_or_insert(lo ^ sc.salt_lo, hi ^ sc.salt_hi, sid);
            match self.entry(publ, h) {
                Entry::Valid(_, old) if old == id => {}
                Entry::Valid(es, old) => {
                    self.drop_pub(old, publ);
                    let gen = self.blocks.t.gen_of(id);
                    self.pubs[publ as usize].engine.put(es, id, gen);
                }
                Entry::Stale(es) => {
                    let gen = self.blocks.t.gen_of(id);
                    self.pubs[publ as usize].engine.put(es, id, gen);
                }
                Entry::Absent => self.engine_insert(publ, h, id),
            }
            while k < pairs.len() && pairs[k].0 as usize == r {
                let s = self.blocks.set(id);
                let t = self.sets.with_loc(s, pairs[k].1);
                self.set_block(id, t);
                k += 1;
            }
        }
        self.tidy(Some(publ));
    }

    pub fn nbytes(&self) -> usize {
        let mut n = self.blocks.t.nbytes();
        n += self.sets.nbytes();
        n += self.members.iter().map(|m| m.capacity() * 4 + 24).sum::<usize>();
        n += self.loc_count.capacity() * 8 + self.loc_pub.capacity() * 4;
        n += self.pubs.iter().map(|p| p.engine.nbytes() + p.locs.capacity() * 4 + 160).sum::<usize>();
        n += self.scopes.capacity() * std::mem::size_of::<Scope>() + (self.free_scopes.capacity() + self.dirty_scopes.capacity()) * 4;
        n
    }

    pub fn blocks_live(&self) -> usize {
        self.blocks.t.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize, tag: u64) -> Vec<(u64, u64)> {
        (0..n as u64).map(|i| (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i, i.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ tag)).collect()
    }

    fn hashes(n: usize, tag: u64) -> Vec<u64> {
        (0..n as u64).map(|i| (tag << 32) | i).collect()
    }

    /// A core with one scope and publishers `pubs`, each with one location: (core, sid, locs).
    fn core(pubs: usize) -> (Core, u32, Vec<u32>) {
        let mut c = Core::new([1, 2, 3, 4]);
        let locs = (0..pubs).map(|_| {
            let p = c.add_publisher();
            c.add_location(p)
        }).collect();
        let (sid, _) = c.add_scope(7, 8).unwrap();
        (c, sid, locs)
    }

    #[test]
    fn a_lookup_answers_runs_per_location() {
        let (mut c, sid, locs) = core(2);
        let ks = keys(10, 1);
        c.store(0, locs[0], sid, &ks[..6], &hashes(6, 1));
        c.store(1, locs[1], sid, &ks[4..8], &hashes(4, 2));
        let mut q = ks.clone();
        q[2] = (0, 0); // absent
        assert_eq!(c.lookup(sid, &q), vec![(locs[0], vec![(0, 2), (3, 6)]), (locs[1], vec![(4, 8)])]);
        let (other, _) = c.add_scope(9, 9).unwrap();
        assert_eq!(c.lookup(other, &ks), vec![], "another scope sees nothing");
        assert_eq!(c.memberships, 10);
        assert_eq!(c.blocks_live(), 8);
    }

    #[test]
    fn removals_and_clears_leave_other_publishers_alone() {
        let (mut c, sid, locs) = core(2);
        let ks = keys(8, 2);
        c.store(0, locs[0], sid, &ks, &hashes(8, 1));
        c.store(1, locs[1], sid, &ks, &hashes(8, 2));
        assert_eq!(c.remove(0, Some(locs[0]), &hashes(3, 1)), 3);
        assert_eq!(c.remove(0, Some(locs[0]), &hashes(3, 9)), 0, "unknown hashes");
        assert_eq!(c.lookup(sid, &ks), vec![(locs[0], vec![(3, 8)]), (locs[1], vec![(0, 8)])]);
        assert_eq!(c.parent_key(0, 1 << 32), None, "the removed block's hash left the map");
        assert_eq!(c.parent_key(0, (1 << 32) | 5), Some(ks[5]));
        c.clear(0, &[locs[0]], true);
        assert_eq!(c.lookup(sid, &ks), vec![(locs[1], vec![(0, 8)])]);
        assert_eq!(c.parent_key(0, (1 << 32) | 5), None);
        assert_eq!((c.memberships, c.blocks_live()), (8, 8));
    }

    #[test]
    fn growing_and_shrinking_keep_every_block() {
        let (mut c, sid, locs) = core(1);
        let n = 60_000;
        let ks = keys(n, 3);
        let hs = hashes(n, 1);
        for s in (0..n).step_by(4096) {
            let e = (s + 4096).min(n);
            c.store(0, locs[0], sid, &ks[s..e], &hs[s..e]);
        }
        assert!(c.blocks.t.rebuilds >= 5, "grew {} times", c.blocks.t.rebuilds);
        assert_eq!(c.lookup(sid, &ks), vec![(locs[0], vec![(0, n as u32)])]);
        for (i, &h) in hs.iter().enumerate() {
            assert_eq!(c.parent_key(0, h), Some(ks[i]));
        }
        let big = c.blocks.t.capacity();
        c.remove(0, Some(locs[0]), &hs[100..]);
        assert!(c.blocks.t.capacity() < big / 8, "shrank to {} slots from {big}", c.blocks.t.capacity());
        assert_eq!(c.lookup(sid, &ks), vec![(locs[0], vec![(0, 100)])]);
        assert_eq!((c.blocks_live(), c.memberships, c.pubs[0].engine.live), (100, 100, 100));
        assert_eq!(c.facts(), vec![(locs[0], vec![sid; 100], {
            let mut k: Vec<(u64, u64)> = ks[..100].to_vec();
            k.sort_unstable_by_key(|&(hi, lo)| c.blocks.t.find(lo ^ 8, hi ^ 7, 1).unwrap());
            k
        })]);
    }

    #[test]
    fn a_presized_table_keeps_its_size() {
        let (mut c, sid, locs) = core(1);
        c.presize(100_000);
        let cap = c.blocks.t.capacity();
        assert!(cap as f64 * MAX_LOAD >= 100_000.0);
        let ks = keys(10, 4);
        c.store(0, locs[0], sid, &ks, &hashes(10, 1));
        c.remove(0, Some(locs[0]), &hashes(10, 1));
        c.store(0, locs[0], sid, &ks, &hashes(10, 1));
        assert_eq!(c.blocks.t.capacity(), cap, "stores into the nearly empty table did not shrink it");
        let rebuilds = c.blocks.t.rebuilds;
        let more = keys(90_000, 5);
        c.store(0, locs[0], sid, &more, &hashes(90_000, 2));
        assert_eq!(c.blocks.t.rebuilds, rebuilds, "growing to the presized count rebuilt nothing");
    }

    #[test]
    fn export_then_restore_reproduces_a_publisher() {
        let (mut c, sid, locs) = core(1);
        let host = c.add_location(0);
        let ks = keys(300, 6);
        c.store(0, locs[0], sid, &ks, &hashes(300, 1));
        c.store_tier(0, host, &hashes(50, 1));
        let (h, k, s, held) = c.export(0);
        let (mut d, sid2, locs2) = core(1);
        let host2 = d.add_location(0);
        assert_eq!((sid2, locs2[0], host2), (sid, locs[0], host));
        d.restore(0, &h, &k, &s, &held);
        assert_eq!(d.lookup(sid, &ks), c.lookup(sid, &ks));
        assert_eq!(d.lookup(sid, &ks), vec![(locs[0], vec![(0, 300)]), (host, vec![(0, 50)])]);
        assert_eq!(d.memberships, 350);
    }

    #[test]
    fn forgetting_drops_whole_blocks_and_counts_them() {
        let (mut c, sid, locs) = core(2);
        let ks = keys(1000, 7);
        c.store(0, locs[0], sid, &ks, &hashes(1000, 1));
        c.store(1, locs[1], sid, &ks[..500], &hashes(500, 2));
        let f = c.forget(600);
        assert!(f.memberships >= 600 && f.blocks <= f.memberships);
        assert_eq!(c.memberships, 1500 - f.memberships);
        assert_eq!(c.blocks_live() as u64, 1000 - f.blocks);
        let g = c.forget_scopes(&[sid]);
        assert_eq!((c.memberships, c.blocks_live()), (0, 0));
        assert_eq!(f.memberships + g.memberships, 1500);
        assert_eq!(c.take_empty_scopes(), vec![sid]);
        assert!(c.release_scope(sid));
        let (again, _) = c.add_scope(1, 1).unwrap();
        assert_eq!(again, sid, "the id is reused");
    }

    #[test]
    fn a_reused_scope_id_gets_another_serial() {
        let (mut c, sid, _) = core(0);
        let first = c.scopes[sid as usize].serial;
        assert!(c.release_scope(sid));
        let (again, serial) = c.add_scope(3, 3).unwrap();
        assert_eq!(again, sid);
        assert_ne!(serial, first);
    }

    #[test]
    fn lookups_run_in_parallel_on_a_shared_core() {
        let (mut c, sid, locs) = core(1);
        let ks = keys(5000, 8);
        c.store(0, locs[0], sid, &ks, &hashes(5000, 1));
        let (c, ks, loc) = (&c, &ks, locs[0]);
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for r in 0..50 {
                        let n = 1 + (t * 997 + r * 31) % 5000;
                        assert_eq!(c.lookup(sid, &ks[..n]), vec![(loc, vec![(0, n as u32)])]);
                    }
                });
            }
        });
    }
}
