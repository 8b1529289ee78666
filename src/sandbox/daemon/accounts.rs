//! The host's account database (NSS: `/etc/passwd` and `/etc/group`, systemd's userdb, a
//! directory service), asked whether a worker uid is free of any account or group.
//!
//! Looking up every id of a 500-id range one by one costs a thousand NSS lookups, each of
//! which walks every configured source (about 80 ms of a daemon's start on a quiet host,
//! more where each lookup is a round trip to a service). So the range is checked in two
//! layers ([`super::identity`]):
//! * at startup and reload, one pass over the accounts and groups NSS can enumerate
//!   ([`Accounts::first_enumerated_in`]): files and systemd's userdb always can; a directory
//!   service only where enumeration is enabled (sssd's `enumerate`);
//! * before a uid is first leased by this process, a lookup of that uid and that gid
//!   ([`Accounts::owner_of`]), which every source answers: no worker runs under an id NSS
//!   names, enumerable or not.
//!
//! The trait is the seam: unit tests give the pool a fake database.

use std::ffi::{c_char, CStr};
use std::sync::Mutex;

/// An account or group using an id of the worker range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// `"uid"` or `"gid"`.
    pub what: &'static str,
    pub id: u32,
    pub name: String,
}

/// The account database, as the worker uid range needs it.
pub trait Accounts: std::fmt::Debug + Send + Sync {
    /// An account or group NSS enumerates whose id is in `first..=last`, if any.
    fn first_enumerated_in(&self, first: u32, last: u32) -> Option<Owner>;
    /// The account with uid `id`, or else the group with gid `id`, if any.
    fn owner_of(&self, id: u32) -> Option<Owner>;
}

/// The host's NSS, through glibc.
#[derive(Debug, Default, Clone, Copy)]
pub struct Nss;

/// `setpwent`/`getpwent_r`/`endpwent` (and the group ones) share one enumeration position
/// per process: one enumeration at a time.
static ENUMERATION: Mutex<()> = Mutex::new(());

/// The largest buffer an entry may need (a group with many members); past it the entry is
/// skipped, as glibc's own tools do on ERANGE at their limit.
const MAX_ENTRY: usize = 1 << 20;

impl Accounts for Nss {
    fn first_enumerated_in(&self, first: u32, last: u32) -> Option<Owner> {
        let _one = ENUMERATION.lock().unwrap_or_else(|p| p.into_inner());
        let wanted = |id: u32| (first..=last).contains(&id);
        // SAFETY: the enumeration state is the process's and ENUMERATION keeps it to one
        // caller at a time; each database is opened, read and closed by its own calls.
        let user = unsafe {
            enumerate_database(
                libc::setpwent,
                libc::getpwent_r,
                libc::endpwent,
                |pw: &libc::passwd| (pw.pw_uid, pw.pw_name),
                wanted,
            )
        };
        let found = match user {
            Some((id, name)) => ("uid", id, name),
            // SAFETY: as above, for the group database.
            None => unsafe {
                let group = enumerate_database(
                    libc::setgrent,
                    libc::getgrent_r,
                    libc::endgrent,
                    |gr: &libc::group| (gr.gr_gid, gr.gr_name),
                    wanted,
                );
                let (id, name) = group?;
                ("gid", id, name)
            },
        };
        Some(Owner {
            what: found.0,
            id: found.1,
            name: found.2,
        })
    }

    fn owner_of(&self, id: u32) -> Option<Owner> {
        if let Ok(Some(user)) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(id)) {
            return Some(Owner {
                what: "uid",
                id,
                name: user.name,
            });
        }
        if let Ok(Some(group)) = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(id)) {
            return Some(Owner {
                what: "gid",
                id,
                name: group.name,
            });
        }
        None
    }
}

/// One pass over an NSS database (`set`, then `get` until the end, then `end`): the first
/// entry whose id (by `id_name`) `wanted` holds, with its name. An entry too large for
/// [`MAX_ENTRY`] ends the pass (an `ERANGE` leaves the position where it was), and so does a
/// source that fails: the lookup before each first lease still answers for them.
///
/// # Safety
/// The caller holds [`ENUMERATION`]; `set`, `get` and `end` are one database's
/// `set*ent`, `get*ent_r` and `end*ent`, and `id_name` reads the entry `get` filled.
unsafe fn enumerate_database<E>(
    set: unsafe extern "C" fn(),
    get: unsafe extern "C" fn(*mut E, *mut c_char, libc::size_t, *mut *mut E) -> libc::c_int,
    end: unsafe extern "C" fn(),
    id_name: impl Fn(&E) -> (u32, *const c_char),
    wanted: impl Fn(u32) -> bool,
) -> Option<(u32, String)> {
    let mut buf: Vec<c_char> = vec![0; 4096];
    // SAFETY: the caller's contract; the entry is plain old data glibc fills, pointing into
    // `buf`, and read before `buf` changes.
    unsafe {
        set();
        let found = loop {
            let mut entry: E = std::mem::zeroed();
            let mut res: *mut E = std::ptr::null_mut();
            match get(&mut entry, buf.as_mut_ptr(), buf.len(), &mut res) {
                0 if !res.is_null() => {
                    let (id, n) = id_name(&entry);
                    if wanted(id) {
                        break Some((id, name(n)));
                    }
                }
                libc::ERANGE if buf.len() < MAX_ENTRY => buf.resize(buf.len() * 2, 0),
                // ENOENT (or a null entry): the end; anything else: the source failed.
                _ => break None,
            }
        };
        end();
        found
    }
}

/// An entry's name.
///
/// # Safety
/// `p` is null or a NUL-terminated string that lives for this call.
unsafe fn name(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root is in every account database: uid 0 and gid 0, by enumeration and by lookup.
    #[test]
    fn the_host_database_names_root_both_ways() {
        let by_pass = Nss.first_enumerated_in(0, 0).expect("root enumerated");
        assert_eq!(
            by_pass,
            Owner {
                what: "uid",
                id: 0,
                name: "root".into()
            }
        );
        assert_eq!(Nss.owner_of(0).map(|o| o.name), Some("root".into()));
        assert_eq!(Nss.first_enumerated_in(4_000_000_000, 4_000_000_010), None);
        assert_eq!(Nss.owner_of(4_000_000_000), None);
    }
}
