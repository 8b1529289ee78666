//! Both protocols between the sandbox's processes, in one place:
//! - [`spawn_request`]: daemon <-> spawner, one packet per request or reply, with descriptors;
//! - [`launch`]: daemon -> pre-exec child, one [`Spec`] as JSON over the launcher channel,
//!   and child -> daemon, [`Report`] lines naming the failed [`Step`].

pub(crate) mod launch;
pub(crate) mod spawn_request;

pub(crate) use launch::{verdict, LandlockSpec, Report, Rlimits, Spec, Verdict, SETUP_FAILED};
pub use launch::{LandlockStatus, Step};
