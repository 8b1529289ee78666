//! Call slots with fair shares: `max_concurrent_calls` slots in all, of which one principal
//! (uid) holds at most `max_calls_per_principal`, with at most `max_queued_per_principal` of
//! its calls waiting; one more is refused at once ([`Busy`]).
//!
//! A call first takes a permit of its principal's share, then a global slot. Both semaphores
//! are FIFO and hand a released permit to their oldest waiter, so a principal's calls never
//! pass each other, and the global queue holds at most a share's worth of calls of each
//! principal: whoever else waits has at most `max_calls_per_principal` calls of every other
//! principal ahead of it, never one principal's whole backlog.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// A call refused because its principal already has its share running and its queue full.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("uid {uid} already has {running} calls running (max_calls_per_principal = {share}) and {waiting} waiting for a slot, the most max_queued_per_principal ({queue}) allows; nothing was run; try again when one of its calls ends")]
pub struct Busy {
    pub uid: u32,
    pub running: usize,
    pub waiting: usize,
    pub share: usize,
    pub queue: usize,
}

/// Why no slot was taken.
#[derive(Debug)]
pub enum NoSlot {
    Busy(Busy),
    /// Cancelled while waiting (or the slots are closed).
    Cancelled,
}

/// One principal's share.
struct Share {
    permits: Arc<Semaphore>,
    /// Calls of this principal between their arrival and holding both permits, when they
    /// could not take both at once.
    waiting: AtomicUsize,
}

type Shares = Arc<Mutex<HashMap<u32, Arc<Share>>>>;

pub struct Slots {
    global: Arc<Semaphore>,
    share: usize,
    queue: usize,
    /// The shares of principals with a call holding or waiting for a slot; an entry goes
    /// with its principal's last such call.
    shares: Shares,
}

/// A held call slot (the global one and one of its principal's share).
pub struct Slot {
    // Fields drop in order: the permits go before the entry checks whether it was the last.
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    _entry: Entry,
}

/// A principal's share, held by a call; the last one out removes it from the map.
struct Entry {
    uid: u32,
    share: Option<Arc<Share>>,
    shares: Shares,
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut shares = lock(&self.shares);
        self.share.take();
        // Every clone is made under this lock: a count of 1 is the map's own.
        if shares
            .get(&self.uid)
            .is_some_and(|s| Arc::strong_count(s) == 1)
        {
            shares.remove(&self.uid);
        }
    }
}

/// Counts a call out of its principal's waiters however its wait ends.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slots {
    pub fn new(total: usize, share: usize, queue: usize) -> Slots {
        Slots {
            global: Arc::new(Semaphore::new(total)),
            share: share.clamp(1, total.max(1)),
            queue,
            shares: Arc::default(),
        }
    }

    /// Principals with a call holding or waiting for a slot.
    #[cfg(test)]
    fn principals(&self) -> usize {
        lock(&self.shares).len()
    }

    /// Takes a slot for a call of `uid`: at once if its share and a global slot are free;
    /// else it waits, if fewer than `queue` of its calls already do, and is refused
    /// otherwise.
    pub async fn acquire(&self, uid: u32, cancel: &CancellationToken) -> Result<Slot, NoSlot> {
        let share = {
            let mut shares = lock(&self.shares);
            shares
                .entry(uid)
                .or_insert_with(|| {
                    Arc::new(Share {
                        permits: Arc::new(Semaphore::new(self.share)),
                        waiting: AtomicUsize::new(0),
                    })
                })
                .clone()
        };
        let entry = Entry {
            uid,
            share: Some(share.clone()),
            shares: self.shares.clone(),
        };
        let own = match share.permits.clone().try_acquire_owned() {
            Ok(own) => match self.global.clone().try_acquire_owned() {
                Ok(global) => {
                    return Ok(Slot {
                        _permits: (global, own),
                        _entry: entry,
                    })
                }
                Err(_) => Some(own),
            },
            Err(_) => None,
        };
        if share.waiting.fetch_add(1, Ordering::SeqCst) >= self.queue {
            share.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(NoSlot::Busy(Busy {
                uid,
                running: self
                    .share
                    .saturating_sub(share.permits.available_permits() + usize::from(own.is_some())),
                waiting: self.queue,
                share: self.share,
                queue: self.queue,
            }));
        }
        let _waiting = Waiting(&share.waiting);
        let own = match own {
            Some(p) => p,
            None => tokio::select! {
                p = share.permits.clone().acquire_owned() => p.map_err(|_| NoSlot::Cancelled)?,
                _ = cancel.cancelled() => return Err(NoSlot::Cancelled),
            },
        };
        let global = tokio::select! {
            p = self.global.clone().acquire_owned() => p.map_err(|_| NoSlot::Cancelled)?,
            _ = cancel.cancelled() => return Err(NoSlot::Cancelled),
        };
        Ok(Slot {
            _permits: (global, own),
            _entry: entry,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_principal_holds_at_most_its_share_waits_at_most_its_queue_and_others_pass() {
        let slots = Arc::new(Slots::new(4, 2, 1));
        let never = CancellationToken::new();
        let a1 = slots.acquire(1, &never).await.unwrap();
        let a2 = slots.acquire(1, &never).await.unwrap();
        // A's third call waits (its share is full), its fourth is refused at once.
        let s = slots.clone();
        let t = never.clone();
        let a3 = tokio::spawn(async move { s.acquire(1, &t).await.map(drop).is_ok() });
        while slots.principals() == 1 && lock(&slots.shares)[&1].waiting.load(Ordering::SeqCst) == 0
        {
            tokio::task::yield_now().await;
        }
        match slots.acquire(1, &never).await {
            Err(NoSlot::Busy(b)) => {
                assert_eq!((b.uid, b.share, b.queue, b.waiting), (1, 2, 1, 1));
                assert!(
                    b.to_string().contains("max_queued_per_principal (1)"),
                    "{b}"
                );
            }
            _ => panic!("a call past the queue was not refused"),
        }
        // B takes the two slots A may not.
        let b1 = slots.acquire(2, &never).await.unwrap();
        let b2 = slots.acquire(2, &never).await.unwrap();
        assert_eq!(slots.principals(), 2);
        drop(a1);
        assert!(a3.await.unwrap(), "A's waiting call got the slot A freed");
        drop((a2, b1, b2));
        assert_eq!(slots.principals(), 0, "idle principals leave no entry");
        // A cancelled waiter leaves no entry either.
        let z = Slots::new(1, 1, 4);
        let held = z.acquire(3, &never).await.unwrap();
        let cancel = CancellationToken::new();
        cancel.cancel();
        assert!(matches!(
            z.acquire(3, &cancel).await,
            Err(NoSlot::Cancelled)
        ));
        drop(held);
        assert_eq!(z.principals(), 0);
    }
}
