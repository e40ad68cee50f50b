//! `nexuskv._native`: the index core of `nexuskv.index.GlobalIndex`, in Rust.
//!
//! The Python side keeps publishers (sequence, incarnation, certainty), identity scopes, key
//! computation and the answer types; this module keeps blocks, location sets and engine-hash
//! maps, and runs the lookup inner loop. Keys cross the boundary as 16-byte big-endian digests
//! (`bytes`, n * 16) or as an `(n, 2)` uint64 array of [high, low] words; engine hashes as a
//! tuple or list of ints, `bytes` (n * 8, little-endian) or a uint64 array.

mod core;
mod files;
mod sets;
mod tables;

use std::sync::{RwLock, TryLockError};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOverflowError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::core::{Core, MAX_LOAD};
use crate::tables::BlockTable;

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
            if !raw.len().is_multiple_of(16) {
                return Err(PyValueError::new_err(format!("keys: {} bytes is not a whole number of 16-byte keys", raw.len())));
            }
            return Ok(Keys::Bytes(raw));
        }
        let buf = PyBuffer::<u64>::get(obj)
            .map_err(|_| PyValueError::new_err("keys: expected bytes (16 per key) or an (n, 2) uint64 array"))?;
        if !buf.is_c_contiguous() || !buf.item_count().is_multiple_of(2) {
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
        if !raw.len().is_multiple_of(8) {
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
    if !raw.len().is_multiple_of(4) {
        return Err(PyValueError::new_err("expected 4 bytes per uint32"));
    }
    Ok(raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
}

/// Why a call failed, made a Python exception once the GIL is held again.
enum Fail {
    Invalid(String),
    Poisoned,
}

impl From<String> for Fail {
    fn from(msg: String) -> Self {
        Fail::Invalid(msg)
    }
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        match f {
            Fail::Invalid(msg) => PyValueError::new_err(msg),
            Fail::Poisoned => PyRuntimeError::new_err(
                "the native index core panicked in an earlier call and its state is not trusted: rebuild the index",
            ),
        }
    }
}

/// Blocks by scoped key, location sets and per-publisher engine-hash maps.
///
/// Thread-safe: the core sits behind a readers-writer lock. Every call first copies its input
/// into Rust-owned data; a call with real work (lookups, events, checkpoints, forgetting) then
/// releases the GIL while it waits for the lock and while it works, and builds its Python answer
/// once it holds the GIL again; a small call takes the lock under the GIL only when it is free at
/// once, else it too releases the GIL to wait. So lookups run in parallel with each other and with
/// Python code, a write excludes them, and no thread ever waits for the lock holding the GIL.
#[pyclass(module = "nexuskv._native", name = "Core", frozen)]
struct PyCore {
    c: RwLock<Core>,
}

impl PyCore {
    /// `f` under the read lock, the GIL released for the wait and the work.
    fn read<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Core) -> Result<R, Fail> + Send) -> PyResult<R> {
        Ok(py.allow_threads(|| f(&*self.c.read().map_err(|_| Fail::Poisoned)?))?)
    }

    /// `f` under the write lock, the GIL released for the wait and the work.
    fn write<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Core) -> Result<R, Fail> + Send) -> PyResult<R> {
        Ok(py.allow_threads(|| f(&mut *self.c.write().map_err(|_| Fail::Poisoned)?))?)
    }

    /// A small read: under the GIL when the lock is free, else as `read`.
    fn peek<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Core) -> Result<R, Fail> + Send) -> PyResult<R> {
        match self.c.try_read() {
            Ok(g) => Ok(f(&g)?),
            Err(TryLockError::WouldBlock) => self.read(py, f),
            Err(TryLockError::Poisoned(_)) => Err(Fail::Poisoned.into()),
        }
    }

    /// A small write: under the GIL when the lock is free, else as `write`.
    fn poke<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Core) -> Result<R, Fail> + Send) -> PyResult<R> {
        match self.c.try_write() {
            Ok(mut g) => Ok(f(&mut g)?),
            Err(TryLockError::WouldBlock) => self.write(py, f),
            Err(TryLockError::Poisoned(_)) => Err(Fail::Poisoned.into()),
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
        Ok(PyCore { c: RwLock::new(Core::new([w(0), w(1), w(2), w(3)])) })
    }

    fn add_publisher(&self, py: Python<'_>) -> PyResult<u32> {
        self.poke(py, |c| Ok(c.add_publisher()))
    }

    fn add_location(&self, py: Python<'_>, publisher: u32) -> PyResult<u32> {
        self.poke(py, |c| {
            c.check_pub(publisher)?;
            Ok(c.add_location(publisher))
        })
    }

    /// A new scope whose keys are mixed with the 16-byte `salt`: (id, serial). The serial is
    /// this scope's alone: an id freed and reused later gets another serial.
    fn add_scope(&self, py: Python<'_>, salt: &[u8]) -> PyResult<(u32, u64)> {
        if salt.len() != 16 {
            return Err(PyValueError::new_err("salt: 16 bytes"));
        }
        let (hi, lo) = be_key(salt);
        self.poke(py, |c| c.add_scope(hi, lo).ok_or_else(|| "65,535 scopes are live: release some first".to_string().into()))
    }

    fn take_empty_scopes(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.poke(py, |c| Ok(c.take_empty_scopes()))
    }

    /// Free a scope id that holds no block; False when it still holds some.
    fn release_scope(&self, py: Python<'_>, sid: u32) -> PyResult<bool> {
        self.poke(py, |c| {
            c.check_scope(sid)?;
            Ok(c.release_scope(sid))
        })
    }

    fn scope_blocks(&self, py: Python<'_>, sid: u32) -> PyResult<u64> {
        self.peek(py, |c| {
            c.check_scope(sid)?;
            Ok(c.scopes[sid as usize].blocks)
        })
    }

    fn store(&self, py: Python<'_>, publisher: u32, loc: u32, sid: u32, keys: &Bound<'_, PyAny>,
             hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = Keys::of(keys)?.to_vec(py);
        let hashes = hashes_of(hashes)?;
        if keys.len() != hashes.len() {
            return Err(PyValueError::new_err(format!("{} keys for {} engine hashes", keys.len(), hashes.len())));
        }
        self.write(py, |c| {
            c.check_loc(publisher, loc)?;
            c.check_scope(sid)?;
            c.store(publisher, loc, sid, &keys, &hashes);
            Ok(keys.len())
        })
    }

    fn store_tier(&self, py: Python<'_>, publisher: u32, loc: u32, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = hashes_of(hashes)?;
        self.write(py, |c| {
            c.check_loc(publisher, loc)?;
            Ok(c.store_tier(publisher, loc, &hashes))
        })
    }

    #[pyo3(signature = (publisher, loc, hashes))]
    fn remove(&self, py: Python<'_>, publisher: u32, loc: Option<u32>, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hashes = hashes_of(hashes)?;
        self.write(py, |c| {
            match loc {
                Some(l) => c.check_loc(publisher, l)?,
                None => c.check_pub(publisher)?,
            }
            Ok(c.remove(publisher, loc, &hashes))
        })
    }

    fn clear(&self, py: Python<'_>, publisher: u32, locs: Vec<u32>, all: bool) -> PyResult<()> {
        self.write(py, |c| {
            for &l in &locs {
                c.check_loc(publisher, l)?;
            }
            c.clear(publisher, &locs, all);
            Ok(())
        })
    }

    fn parent_key<'py>(&self, py: Python<'py>, publisher: u32, engine_hash: u64) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let key = self.peek(py, |c| {
            c.check_pub(publisher)?;
            Ok(c.parent_key(publisher, engine_hash))
        })?;
        Ok(key.map(|k| be_bytes_keys(py, &[k])))
    }

    /// `[(loc, prefix_blocks, ((start, end), ...)), ...]` for every location holding a key.
    /// With `serial` (from `add_scope`): None when `sid` is no longer that scope (released, maybe
    /// reused), instead of an error or another scope's blocks.
    #[pyo3(signature = (sid, keys, serial = None))]
    fn lookup<'py>(&self, py: Python<'py>, sid: u32, keys: &Bound<'py, PyAny>, serial: Option<u64>)
                   -> PyResult<Option<Bound<'py, PyList>>> {
        let keys = Keys::of(keys)?.to_vec(py);
        let found = self.read(py, |c| match serial {
            Some(s) if !(c.scope_live(sid) && c.scopes[sid as usize].serial == s) => Ok(None),
            _ => {
                c.check_scope(sid)?;
                Ok(Some(c.lookup(sid, &keys)))
            }
        })?;
        let Some(acc) = found else { return Ok(None) };
        let out = PyList::empty(py);
        for (loc, runs) in acc {
            let (prefix, rest) = if runs[0].0 == 0 { (runs[0].1, &runs[1..]) } else { (0, &runs[..]) };
            let ext = PyTuple::new(py, rest.iter().map(|&(s, e)| (s, e)))?;
            out.append((loc, prefix, ext))?;
        }
        Ok(Some(out))
    }

    /// Size the block table for `blocks` blocks now, so growing to them rebuilds nothing.
    fn presize(&self, py: Python<'_>, blocks: usize) -> PyResult<()> {
        let most = BlockTable::max_keys(MAX_LOAD);
        if blocks > most {
            return Err(PyValueError::new_err(format!(
                "presize: {blocks} blocks is more than a block table holds with 32-bit slot ids ({most})"
            )));
        }
        self.write(py, |c| {
            c.presize(blocks);
            Ok(())
        })
    }

    /// Forget whole blocks until `excess` memberships are gone: (memberships, blocks) forgotten.
    fn forget(&self, py: Python<'_>, excess: u64) -> PyResult<(u64, u64)> {
        self.write(py, |c| {
            let f = c.forget(excess);
            Ok((f.memberships, f.blocks))
        })
    }

    fn forget_scopes(&self, py: Python<'_>, sids: Vec<u32>) -> PyResult<(u64, u64)> {
        self.write(py, |c| {
            let f = c.forget_scopes(&sids);
            Ok((f.memberships, f.blocks))
        })
    }

    /// `[(loc, scope ids as uint32 bytes, keys as 16-byte digests), ...]`.
    #[allow(clippy::type_complexity)]
    fn facts<'py>(&self, py: Python<'py>) -> PyResult<Vec<(u32, Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
        let facts = self.read(py, |c| Ok(c.facts()))?;
        Ok(facts
            .into_iter()
            .map(|(loc, scopes, keys)| (loc, le_bytes_u32(py, &scopes), be_bytes_keys(py, &keys)))
            .collect())
    }

    /// A publisher's state: (hashes u64 LE bytes, keys 16-byte digests, scope ids u32 LE bytes,
    /// [(loc, rows u32 LE bytes), ...]).
    #[allow(clippy::type_complexity)]
    fn export<'py>(&self, py: Python<'py>, publisher: u32)
                   -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Vec<(u32, Bound<'py, PyBytes>)>)> {
        let (h, k, s, held) = self.read(py, |c| {
            c.check_pub(publisher)?;
            Ok(c.export(publisher))
        })?;
        let held = held.into_iter().map(|(loc, rows)| (loc, le_bytes_u32(py, &rows))).collect();
        Ok((le_bytes_u64(py, &h), be_bytes_keys(py, &k), le_bytes_u32(py, &s), held))
    }

    fn restore(&self, py: Python<'_>, publisher: u32, hashes: &Bound<'_, PyAny>, keys: &Bound<'_, PyAny>,
               scopes: &[u8], held: Vec<(u32, Vec<u8>)>) -> PyResult<()> {
        let hashes = hashes_of(hashes)?;
        let keys = Keys::of(keys)?.to_vec(py);
        let scopes = u32s(scopes)?;
        if keys.len() != hashes.len() || scopes.len() != hashes.len() {
            return Err(PyValueError::new_err("restore: hashes, keys and scopes differ in length"));
        }
        let mut rows = Vec::with_capacity(held.len());
        for (loc, raw) in held {
            let r = u32s(&raw)?;
            if r.iter().any(|&x| x as usize >= hashes.len()) {
                return Err(PyValueError::new_err("restore: a held row is out of range"));
            }
            rows.push((loc, r));
        }
        self.write(py, |c| {
            c.check_pub(publisher)?;
            for &s in &scopes {
                c.check_scope(s)?;
            }
            for (loc, _) in &rows {
                c.check_loc(publisher, *loc)?;
            }
            c.restore(publisher, &hashes, &keys, &scopes, &rows);
            Ok(())
        })
    }

    #[getter]
    fn memberships(&self, py: Python<'_>) -> PyResult<u64> {
        self.peek(py, |c| Ok(c.memberships))
    }

    #[getter]
    fn blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |c| Ok(c.blocks_live()))
    }

    #[getter]
    fn live_scopes(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |c| Ok(c.live_scopes()))
    }

    #[getter]
    fn location_sets(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |c| Ok(c.sets.len()))
    }

    /// Bytes held by the core's tables and lists (allocated capacity; lookups' per-thread working
    /// arrays not included).
    #[getter]
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |c| Ok(c.nbytes()))
    }
}

/// Per payload file: None when it is in place, else `(errno or None, message)`.
type WriteOutcome = Option<(Option<i32>, String)>;

/// Write payload files for the disk tier, the GIL released for the whole batch (see `files.rs`).
///
/// `items`: `(temporary path, path, header bytes, data)`, data any C-contiguous byte buffer (a
/// uint8 tensor's memoryview). Returns, per item, None when the file is in place, else
/// `(errno or None, message)`; a failed item's temporary file is removed, later items still written.
#[pyfunction]
#[pyo3(signature = (items, fsync=false))]
fn write_payload_files(
    py: Python<'_>,
    items: Vec<(String, String, Vec<u8>, Bound<'_, PyAny>)>,
    fsync: bool,
) -> PyResult<Vec<WriteOutcome>> {
    let mut bufs = Vec::with_capacity(items.len());
    for (_, path, _, data) in &items {
        let buf = PyBuffer::<u8>::get(data)
            .map_err(|e| PyValueError::new_err(format!("{path}: the data is not a byte buffer: {e}")))?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!("{path}: the data is not C-contiguous")));
        }
        bufs.push(buf);
    }
    // The buffers stay exported (and their memory alive) until `bufs` drops, after the writes.
    let spans: Vec<(usize, usize)> = bufs.iter().map(|b| (b.buf_ptr() as usize, b.len_bytes())).collect();
    let names: Vec<(&str, &str, &[u8])> = items.iter().map(|(t, p, h, _)| (t.as_str(), p.as_str(), h.as_slice())).collect();
    let out = py.allow_threads(|| {
        let batch: Vec<files::Item<'_>> = names
            .iter()
            .zip(&spans)
            .map(|(&(tmp, path, header), &(ptr, len))| files::Item {
                tmp,
                path,
                header,
                // SAFETY: `bufs` holds the exports of these buffers for the whole call.
                data: unsafe { std::slice::from_raw_parts(ptr as *const u8, len) },
            })
            .collect();
        files::write_files(&batch, fsync)
    });
    drop(bufs);
    Ok(out.into_iter().map(|e| e.map(|e| (e.raw_os_error(), e.to_string()))).collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCore>()?;
    m.add_function(wrap_pyfunction!(write_payload_files, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
