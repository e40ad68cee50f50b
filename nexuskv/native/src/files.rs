//! Payload files for the disk tier (`nexuskv.dataplane.disk`), many in one call, GIL released.
//!
//! Each file is written as the disk tier always writes one: its header and data with one
//! `writev` into a temporary name, then renamed into place, so a crash never leaves a torn
//! payload under a real name. Writing a save's blocks from Python costs four GIL round trips
//! per block (open, writev, close, rename); a Python thread taking the GIL back after each one
//! is what slows the engine's step thread beside it. Here a whole batch is one.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::os::unix::fs::OpenOptionsExt;

/// One payload file to write: where (a temporary name, then the real one), its header, its data.
pub struct Item<'a> {
    pub tmp: &'a str,
    pub path: &'a str,
    pub header: &'a [u8],
    pub data: &'a [u8],
}

fn write_both(f: &mut File, a: &[u8], b: &[u8]) -> io::Result<()> {
    let total = a.len() + b.len();
    let mut off = 0;
    while off < total {
        let got = if off < a.len() {
            f.write_vectored(&[IoSlice::new(&a[off..]), IoSlice::new(b)])
        } else {
            f.write(&b[off - a.len()..])
        };
        match got {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the file took no more bytes")),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_one(item: &Item<'_>, fsync: bool) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(item.tmp)?;
    write_both(&mut f, item.header, item.data)?;
    if fsync {
        f.sync_all()?;
    }
    drop(f);
    std::fs::rename(item.tmp, item.path)
}

/// Write every item; per item `None` when it is in place, else the error (its temporary file removed).
pub fn write_files(items: &[Item<'_>], fsync: bool) -> Vec<Option<io::Error>> {
    items
        .iter()
        .map(|item| match write_one(item, fsync) {
            Ok(()) => None,
            Err(e) => {
                let _ = std::fs::remove_file(item.tmp);
                Some(e)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("nexuskv-native-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn writes_header_then_data_under_the_real_name_only() {
        let dir = scratch("ok");
        let data: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
        let (tmp, path) = (dir.join("a.tmp"), dir.join("a.nkv"));
        let items = [Item { tmp: tmp.to_str().unwrap(), path: path.to_str().unwrap(), header: b"HEAD", data: &data }];
        let out = write_files(&items, true);
        assert!(out[0].is_none());
        let got = std::fs::read(&path).unwrap();
        assert_eq!(&got[..4], b"HEAD");
        assert_eq!(&got[4..], &data[..]);
        assert!(!tmp.exists());
    }

    #[test]
    fn a_failed_item_is_reported_and_the_others_are_written() {
        let dir = scratch("fail");
        let missing = dir.join("no-such-folder");
        let (bad_tmp, bad) = (missing.join("b.tmp"), missing.join("b.nkv"));
        let (tmp, path) = (dir.join("c.tmp"), dir.join("c.nkv"));
        let items = [
            Item { tmp: bad_tmp.to_str().unwrap(), path: bad.to_str().unwrap(), header: b"H", data: b"x" },
            Item { tmp: tmp.to_str().unwrap(), path: path.to_str().unwrap(), header: b"H", data: b"yz" },
        ];
        let out = write_files(&items, false);
        assert_eq!(out[0].as_ref().unwrap().kind(), io::ErrorKind::NotFound);
        assert!(out[1].is_none());
        assert_eq!(std::fs::read(&path).unwrap(), b"Hyz");
        assert!(!bad.exists());
    }

    #[test]
    fn a_file_already_there_is_replaced_whole() {
        let dir = scratch("replace");
        let (tmp, path) = (dir.join("d.tmp"), dir.join("d.nkv"));
        std::fs::write(&path, vec![7u8; 1000]).unwrap();
        let items = [Item { tmp: tmp.to_str().unwrap(), path: path.to_str().unwrap(), header: b"HH", data: b"new" }];
        assert!(write_files(&items, false)[0].is_none());
        assert_eq!(std::fs::read(&path).unwrap(), b"HHnew");
    }
}
