//! Deadlines for the waits `program_eval_async` makes on a normal scheduler.
//!
//! Such a wait sleeps with no timeout: on the VM the bench runs on, a timed sleep made
//! each wake-up of a ~100 us evaluation some 15 us later (arming and cancelling a timer
//! is not free there), whatever the timeout. This thread wakes the waits that pass their
//! deadline instead. While waits come and go it checks them every `TICK`; after `IDLE`
//! without any it sleeps until the next one.
use std::sync::{Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

const TICK: Duration = Duration::from_micros(1000);
const IDLE: Duration = Duration::from_millis(100);

/// What a passed deadline calls (from this module's thread).
pub trait Expire: Send + Sync {
    fn expire(&self);
}

struct Watch {
    id: u64,
    deadline: Instant,
    target: Weak<dyn Expire>,
}

struct State {
    watches: Vec<Watch>,
    next_id: u64,
    asleep: bool,
    last_active: Instant,
}

struct Watchdog {
    state: Mutex<State>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<&'static Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watchdog = Box::leak(Box::new(Watchdog {
            state: Mutex::new(State {
                watches: Vec::new(),
                next_id: 0,
                asleep: false,
                last_active: Instant::now(),
            }),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("emily-deadline".into())
            .spawn(move || run(w))
            .expect("spawn the deadline thread");
        w
    })
}

/// Watches `deadline` for `target` until the ticket is dropped.
pub fn watch(deadline: Instant, target: Weak<dyn Expire>) -> Ticket {
    let w = watchdog();
    let mut st = w.state.lock().unwrap();
    let id = st.next_id;
    st.next_id += 1;
    st.watches.push(Watch { id, deadline, target });
    if st.asleep {
        st.asleep = false;
        drop(st);
        w.wake.notify_one();
    }
    Ticket(id)
}

/// Ends its watch when dropped.
pub struct Ticket(u64);

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = watchdog().state.lock().unwrap();
        if let Some(i) = st.watches.iter().position(|w| w.id == self.0) {
            st.watches.swap_remove(i);
        }
    }
}

fn run(w: &'static Watchdog) {
    let mut st = w.state.lock().unwrap();
    loop {
        if st.watches.is_empty() && st.last_active.elapsed() > IDLE {
            st.asleep = true;
            st = w.wake.wait_while(st, |s| s.asleep).unwrap();
            st.last_active = Instant::now();
            continue;
        }
        drop(st);
        std::thread::sleep(TICK);
        st = w.state.lock().unwrap();
        let now = Instant::now();
        if !st.watches.is_empty() {
            st.last_active = now;
        }
        let expired: Vec<_> =
            st.watches.iter().filter(|w| w.deadline <= now).filter_map(|w| w.target.upgrade()).collect();
        if !expired.is_empty() {
            drop(st);
            for t in expired {
                t.expire();
            }
            st = w.state.lock().unwrap();
        }
    }
}
