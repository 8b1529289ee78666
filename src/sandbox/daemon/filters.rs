//! Seccomp programs compiled once per profile, when a policy is loaded or reloaded, instead
//! of once per call.
//!
//! The executor owns one [`Filters`] and calls [`Filters::prepare`] with every profile of the
//! policy it starts on and of each policy SIGHUP brings; [`super::Worker::spawn`] takes the
//! program of its call's profile from it. A profile is the policy's `Arc<Profile>`, so the key
//! is that `Arc` (by address, the entry holding a clone so the address is never reused while
//! it is a key): a reloaded policy's profiles are new keys, and a call in flight on the old
//! policy still finds the old ones. An entry is forgotten at the next `prepare` once nothing
//! else holds its profile (the old policy and its last call are gone).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::policy::Profile;

use super::seccomp::{self, SeccompError};

/// A profile's filters, compiled and encoded, in installation order: what its worker
/// template installs once (`template`) and the seal each worker forked from it installs
/// last (`seal`); see [`seccomp::build_split`]. `id` names the template in the spawner,
/// unique in the process (a reloaded profile is a new id, hence a new template).
#[derive(Debug)]
pub(crate) struct Programs {
    pub(crate) id: u64,
    pub(crate) template: Vec<Vec<(u16, u8, u8, u32)>>,
    pub(crate) seal: Vec<Vec<(u16, u8, u8, u32)>>,
}

/// The next [`Programs::id`] (never 0).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

struct Entry {
    profile: Arc<Profile>,
    /// Workers sharing the daemon's uid get stricter metadata rules: another program.
    shared_uid: bool,
    programs: Arc<Programs>,
}

/// The compiled seccomp programs of the profiles in use.
#[derive(Default)]
pub struct Filters {
    entries: Mutex<Vec<Entry>>,
    compilations: AtomicU64,
    /// Ids of programs forgotten since the last [`Filters::take_forgotten`]: their templates
    /// are to be stopped.
    forgotten: Mutex<Vec<u64>>,
}

impl std::fmt::Debug for Filters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filters")
            .field("profiles", &self.lock().len())
            .field("compilations", &self.compilations())
            .finish()
    }
}

impl Filters {
    pub fn new() -> Filters {
        Filters::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Compiles the programs of `profiles` not compiled yet (for workers that share the
    /// daemon's uid, or not), and forgets those of profiles nothing else holds any more.
    /// Every profile is tried; the first error is returned.
    pub fn prepare<'a>(
        &self,
        profiles: impl IntoIterator<Item = &'a Arc<Profile>>,
        shared_uid: bool,
    ) -> Result<(), SeccompError> {
        self.sweep();
        let mut first = None;
        for p in profiles {
            if let Err(e) = self.get(p, shared_uid) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The programs of `profile`, compiled now if `prepare` has not (a profile built outside
    /// a loaded policy, as tests do).
    pub(crate) fn get(
        &self,
        profile: &Arc<Profile>,
        shared_uid: bool,
    ) -> Result<Arc<Programs>, SeccompError> {
        let find = |entries: &[Entry]| {
            entries
                .iter()
                .find(|e| Arc::ptr_eq(&e.profile, profile) && e.shared_uid == shared_uid)
                .map(|e| e.programs.clone())
        };
        if let Some(p) = find(&self.lock()) {
            return Ok(p);
        }
        // Compiled outside the lock: spawns of other profiles do not wait for it.
        let (template, seal) = seccomp::build_split(profile, shared_uid)?;
        let programs = Arc::new(Programs {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            template: template.iter().map(seccomp::encode).collect(),
            seal: seal.iter().map(seccomp::encode).collect(),
        });
        self.compilations.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.lock();
        if let Some(p) = find(&entries) {
            return Ok(p);
        }
        entries.push(Entry {
            profile: profile.clone(),
            shared_uid,
            programs: programs.clone(),
        });
        Ok(programs)
    }

    /// Forgets the programs of profiles nothing else holds any more (an old policy whose
    /// last call is gone), keeping their ids for [`Filters::take_forgotten`].
    fn sweep(&self) {
        let mut gone = Vec::new();
        self.lock().retain(|e| {
            let kept = Arc::strong_count(&e.profile) > 1;
            if !kept {
                gone.push(e.programs.id);
            }
            kept
        });
        self.forgotten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(gone);
    }

    /// The ids of the programs forgotten since the last call (checked now: a reload's
    /// `prepare` runs while the old policy is still current), whose templates can go. A few
    /// entries at most: called at every spawn.
    pub(crate) fn take_forgotten(&self) -> Vec<u64> {
        self.sweep();
        std::mem::take(&mut *self.forgotten.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// How many programs were compiled so far (each profile once per uid mode, unless
    /// forgotten).
    pub fn compilations(&self) -> u64 {
        self.compilations.load(Ordering::Relaxed)
    }

    /// How many profiles have programs.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::SeccompMode;

    fn profile() -> Arc<Profile> {
        Arc::new(seccomp::tests::profile(
            SeccompMode::Deny,
            &["ptrace", "mount"],
            false,
        ))
    }

    #[test]
    fn a_profile_is_compiled_once_and_reused_across_calls() {
        let filters = Filters::new();
        let (a, b) = (profile(), profile());
        filters.prepare([&a, &b], true).unwrap();
        assert_eq!(filters.compilations(), 2);
        let first = filters.get(&a, true).unwrap();
        for _ in 0..100 {
            assert!(Arc::ptr_eq(&filters.get(&a, true).unwrap(), &first));
        }
        filters.get(&b, true).unwrap();
        assert_eq!(filters.compilations(), 2, "no compilation per call");
        // The same programs as a fresh build.
        let (template, seal) = seccomp::build_split(&a, true).unwrap();
        let encoded =
            |v: Vec<seccompiler::BpfProgram>| -> Vec<_> { v.iter().map(seccomp::encode).collect() };
        assert_eq!(first.template, encoded(template));
        assert_eq!(first.seal, encoded(seal));
        // Another uid mode is another program (and template), compiled once too.
        let other = filters.get(&a, false).unwrap();
        assert_ne!(other.template, first.template);
        assert_ne!(other.id, first.id);
        filters.get(&a, false).unwrap();
        assert_eq!(filters.compilations(), 3);
        // Preparing the same policy again compiles nothing.
        filters.prepare([&a, &b], true).unwrap();
        assert_eq!(filters.compilations(), 3);
    }

    #[test]
    fn a_reloaded_policy_gets_its_own_programs_and_the_old_ones_go_with_their_last_user() {
        let filters = Filters::new();
        let old = profile();
        filters.prepare([&old], true).unwrap();
        let in_flight = filters.get(&old, true).unwrap();
        // SIGHUP: a new policy, whose profile is a new Arc (even if equal).
        let new = profile();
        filters.prepare([&new], true).unwrap();
        assert_eq!(filters.compilations(), 2);
        // A call still on the old policy finds its program without compiling.
        assert!(Arc::ptr_eq(&filters.get(&old, true).unwrap(), &in_flight));
        assert_eq!(filters.len(), 2);
        assert!(filters.take_forgotten().is_empty());
        assert_eq!(filters.len(), 2);
        // Once the old policy is gone, the next spawn's look forgets its program, and names
        // it once for its template to be stopped.
        let old_id = in_flight.id;
        drop(old);
        assert_eq!(filters.take_forgotten(), vec![old_id]);
        assert!(filters.take_forgotten().is_empty());
        assert_eq!(filters.len(), 1);
        assert_eq!(filters.compilations(), 2);
    }
}
