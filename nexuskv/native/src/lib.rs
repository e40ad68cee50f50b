//! `nexuskv._native`: the index core of `nexuskv.index.GlobalIndex`, in Rust.
//!
//! The Python side keeps publishers (sequence, incarnation, certainty), identity scopes, key
//! computation and the answer types; this module keeps blocks, location sets and engine-hash
//! maps, and runs the lookup inner loop. Keys cross the boundary as 16-byte big-endian digests
//! (`bytes`, n * 16) or as an `(n, 2)` uint64 array of [high, low] words; engine hashes as a
//! tuple or list of ints, `bytes` (n * 8, little-endian) or a uint64 array.

mod core;
mod sets;
mod tables;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyValueError, PyOverflowError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::core::Core;

fn be_key(b: &[u8]) -> (u64, u64) {
    let hi = u64::from_be_bytes(b[0..8].try_into().expect("8 bytes"));
    let lo = u64::from_be_bytes(b[8..16].try_into().expect("8 bytes"));
    (hi, lo)
}

enum Keys<'a> {
    Bytes(&'a [u8]),
    Words(PyBuffer<u64>),
}

impl<'a> Keys<'a> {
    fn of(obj: &'a Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.downcast::<PyBytes>() {
            let raw = b.as_bytes();
            if raw.len() % 16 != 0 {
                return Err(PyValueError::new_err(format!("keys: {} bytes is not a whole number of 16-byte keys", raw.len())));
            }
            return Ok(Keys::Bytes(raw));
        }
        let buf = PyBuffer::<u64>::get(obj)
            .map_err(|_| PyValueError::new_err("keys: expected bytes (16 per key) or an (n, 2) uint64 array"))?;
        if !buf.is_c_contiguous() || buf.item_count() % 2 != 0 {
            return Err(PyValueError::new_err("keys: the uint64 array must be C-contiguous with shape (n, 2)"));
        }
        Ok(Keys::Words(buf))
    }

    fn len(&self) -> usize {
        match self {
            Keys::Bytes(b) => b.len() / 16,
            Keys::Words(w) => w.item_count() / 2,
        }
    }

    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&dyn Fn(usize) -> (u64, u64)) -> R) -> R {
        match self {
            Keys::Bytes(b) => f(&|i| be_key(&b[i * 16..i * 16 + 16])),
            Keys::Words(w) => {
                let cells = w.as_slice(py).expect("C-contiguous");
                f(&|i| (cells[2 * i].get(), cells[2 * i + 1].get()))
            }
        }
    }

    fn to_vec(&self, py: Python<'_>) -> Vec<(u64, u64)> {
        let n = self.len();
        self.with(py, |k| (0..n).map(k).collect())
    }
}

fn hashes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        let raw = b.as_bytes();
        if raw.len() % 8 != 0 {
            return Err(PyValueError::new_err("engine hashes: bytes must hold 8 per hash"));
        }
        return Ok(raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect());
    }
    if obj.downcast::<PyTuple>().is_ok() || obj.downcast::<PyList>().is_ok() {
        return obj.extract::<Vec<u64>>().map_err(|e| {
            PyOverflowError::new_err(format!("engine hashes: each must be an int in [0, 2**64) ({e})"))
        });
    }
    let buf = PyBuffer::<u64>::get(obj)
        .map_err(|_| PyValueError::new_err("engine hashes: expected ints, bytes or a uint64 array"))?;
    Python::with_gil(|py| buf.to_vec(py))
}

fn le_bytes_u64<'py>(py: Python<'py>, v: &[u64]) -> Bound<'py, PyBytes> {
    PyBytes::new_with(py, v.len() * 8, |out| {
        for (c, x) in out.chunks_exact_mut(8).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    })
    .expect("allocation")
}

fn le_bytes_u32<'py>(py: Python<'py>, v: &[u32]) -> Bound<'py, PyBytes> {
    PyBytes::new_with(py, v.len() * 4, |out| {
        for (c, x) in out.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    })
    .expect("allocation")
}

fn be_bytes_keys<'py>(py: Python<'py>, v: &[(u64, u64)]) -> Bound<'py, PyBytes> {
    PyBytes::new_with(py, v.len() * 16, |out| {
        for (c, (hi, lo)) in out.chunks_exact_mut(16).zip(v) {
            c[..8].copy_from_slice(&hi.to_be_bytes());
            c[8..].copy_from_slice(&lo.to_be_bytes());
        }
        Ok(())
    })
    .expect("allocation")
}

fn u32s(raw: &[u8]) -> PyResult<Vec<u32>> {
    if raw.len() % 4 != 0 {
        return Err(PyValueError::new_err("expected 4 bytes per uint32"));
    }
    Ok(raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
}

/// Blocks by scoped key, location sets and per-publisher engine-hash maps.
#[pyclass(module = "nexuskv._native", name = "Core")]
struct PyCore {
    c: Core,
}

impl PyCore {
    fn check_pub(&self, publ: u32) -> PyResult<()> {
        if (publ as usize) < self.c.pubs.len() {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!("unknown publisher id {publ}")))
        }
    }

    fn check_loc(&self, publ: u32, loc: u32) -> PyResult<()> {
        self.check_pub(publ)?;
        if (loc as usize) < self.c.loc_pub.len() && self.c.loc_pub[loc as usize] == publ {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!("location {loc} is not publisher {publ}'s")))
        }
    }

    fn check_scope(&self, sid: u32) -> PyResult<()> {
        if (sid as usize) < self.c.scopes.len() && self.c.scopes[sid as usize].live {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!("unknown scope id {sid}")))
        }
    }
}

#[pymethods]
impl PyCore {
    /// `seed`: 32 bytes choosing the tables' hash functions (randomness, passed in).
    #[new]
    fn new(seed: &[u8]) -> PyResult<Self> {
        if seed.len() != 32 {
            return Err(PyValueError::new_err("seed: 32 bytes"));
        }
        let w = |i: usize| u64::from_le_bytes(seed[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Ok(PyCore { c: Core::new([w(0), w(1), w(2), w(3)]) })
    }

    fn add_publisher(&mut self) -> u32 {
        self.c.add_publisher()
    }

    fn add_location(&mut self, publisher: u32) -> PyResult<u32> {
        self.check_pub(publisher)?;
        Ok(self.c.add_location(publisher))
    }

    /// A new scope whose keys are mixed with the 16-byte `salt`; returns its id.
    fn add_scope(&mut self, salt: &[u8]) -> PyResult<u32> {
        if salt.len() != 16 {
            return Err(PyValueError::new_err("salt: 16 bytes"));
        }
        let (hi, lo) = be_key(salt);
        self.c.add_scope(hi, lo).ok_or_else(|| PyValueError::new_err("65,535 scopes are live: release some first"))
    }

    fn take_empty_scopes(&mut self) -> Vec<u32> {
        self.c.take_empty_scopes()
    }

    /// Free a scope id that holds no block; False when it still holds some.
    fn release_scope(&mut self, sid: u32) -> PyResult<bool> {
        self.check_scope(sid)?;
        Ok(self.c.release_scope(sid))
    }

    fn scope_blocks(&self, sid: u32) -> PyResult<u64> {
        self.check_scope(sid)?;
        Ok(self.c.scopes[sid as usize].blocks)
    }

    fn store(&mut self, py: Python<'_>, publisher: u32, loc: u32, sid: u32, keys: &Bound<'_, PyAny>,
             hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.check_loc(publisher, loc)?;
        self.check_scope(sid)?;
        let keys = Keys::of(keys)?.to_vec(py);
        let hashes = hashes_of(hashes)?;
        if keys.len() != hashes.len() {
            return Err(PyValueError::new_err(format!("{} keys for {} engine hashes", keys.len(), hashes.len())));
        }
        self.c.store(publisher, loc, sid, &keys, &hashes);
        Ok(keys.len())
    }

    fn store_tier(&mut self, publisher: u32, loc: u32, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.check_loc(publisher, loc)?;
        let hashes = hashes_of(hashes)?;
        Ok(self.c.store_tier(publisher, loc, &hashes))
    }

    #[pyo3(signature = (publisher, loc, hashes))]
    fn remove(&mut self, publisher: u32, loc: Option<u32>, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        match loc {
            Some(l) => self.check_loc(publisher, l)?,
            None => self.check_pub(publisher)?,
        }
        let hashes = hashes_of(hashes)?;
        Ok(self.c.remove(publisher, loc, &hashes))
    }

    fn clear(&mut self, publisher: u32, locs: Vec<u32>, all: bool) -> PyResult<()> {
        for &l in &locs {
            self.check_loc(publisher, l)?;
        }
        self.c.clear(publisher, &locs, all);
        Ok(())
    }

    fn parent_key<'py>(&self, py: Python<'py>, publisher: u32, engine_hash: u64) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.check_pub(publisher)?;
        Ok(self.c.parent_key(publisher, engine_hash).map(|k| be_bytes_keys(py, &[k])))
    }

    /// `[(loc, prefix_blocks, ((start, end), ...)), ...]` for every location holding a key.
    fn lookup<'py>(&mut self, py: Python<'py>, sid: u32, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        self.check_scope(sid)?;
        let keys = Keys::of(keys)?;
        let n = keys.len();
        let c = &mut self.c;
        let acc = keys.with(py, |k| c.lookup(sid, n, k));
        let out = PyList::empty(py);
        for (loc, runs) in acc {
            let (prefix, rest) = if runs[0].0 == 0 { (runs[0].1, &runs[1..]) } else { (0, &runs[..]) };
            let ext = PyTuple::new(py, rest.iter().map(|&(s, e)| (s, e)))?;
            out.append((loc, prefix, ext))?;
        }
        Ok(out)
    }

    /// Size the block table for `blocks` blocks now, so growing to them rebuilds nothing.
    fn presize(&mut self, blocks: usize) {
        self.c.presize(blocks);
    }

    /// Forget whole blocks until `excess` memberships are gone: (memberships, blocks) forgotten.
    fn forget(&mut self, excess: u64) -> (u64, u64) {
        let f = self.c.forget(excess);
        (f.memberships, f.blocks)
    }

    fn forget_scopes(&mut self, sids: Vec<u32>) -> (u64, u64) {
        let f = self.c.forget_scopes(&sids);
        (f.memberships, f.blocks)
    }

    /// `[(loc, scope ids as uint32 bytes, keys as 16-byte digests), ...]`.
    fn facts<'py>(&self, py: Python<'py>) -> Vec<(u32, Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        self.c
            .facts()
            .into_iter()
            .map(|(loc, scopes, keys)| (loc, le_bytes_u32(py, &scopes), be_bytes_keys(py, &keys)))
            .collect()
    }

    /// A publisher's state: (hashes u64 LE bytes, keys 16-byte digests, scope ids u32 LE bytes,
    /// [(loc, rows u32 LE bytes), ...]).
    #[allow(clippy::type_complexity)]
    fn export<'py>(&self, py: Python<'py>, publisher: u32)
                   -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Vec<(u32, Bound<'py, PyBytes>)>)> {
        self.check_pub(publisher)?;
        let (h, k, s, held) = self.c.export(publisher);
        let held = held.into_iter().map(|(loc, rows)| (loc, le_bytes_u32(py, &rows))).collect();
        Ok((le_bytes_u64(py, &h), be_bytes_keys(py, &k), le_bytes_u32(py, &s), held))
    }

    fn restore(&mut self, py: Python<'_>, publisher: u32, hashes: &Bound<'_, PyAny>, keys: &Bound<'_, PyAny>,
               scopes: &[u8], held: Vec<(u32, Vec<u8>)>) -> PyResult<()> {
        self.check_pub(publisher)?;
        let hashes = hashes_of(hashes)?;
        let keys = Keys::of(keys)?.to_vec(py);
        let scopes = u32s(scopes)?;
        if keys.len() != hashes.len() || scopes.len() != hashes.len() {
            return Err(PyValueError::new_err("restore: hashes, keys and scopes differ in length"));
        }
        for &s in &scopes {
            self.check_scope(s)?;
        }
        let mut rows = Vec::with_capacity(held.len());
        for (loc, raw) in held {
            self.check_loc(publisher, loc)?;
            let r = u32s(&raw)?;
            if r.iter().any(|&x| x as usize >= hashes.len()) {
                return Err(PyValueError::new_err("restore: a held row is out of range"));
            }
            rows.push((loc, r));
        }
        self.c.restore(publisher, &hashes, &keys, &scopes, &rows);
        Ok(())
    }

    #[getter]
    fn memberships(&self) -> u64 {
        self.c.memberships
    }

    #[getter]
    fn blocks(&self) -> usize {
        self.c.blocks_live()
    }

    #[getter]
    fn live_scopes(&self) -> usize {
        self.c.live_scopes()
    }

    #[getter]
    fn location_sets(&self) -> usize {
        self.c.sets.len()
    }

    /// Bytes held by the core's tables and lists (allocated capacity).
    #[getter]
    fn nbytes(&self) -> usize {
        self.c.nbytes()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCore>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
