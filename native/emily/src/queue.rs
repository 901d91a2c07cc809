//! The job queue between the schedulers and one worker thread: many producers, one
//! consumer, lock-free.
//!
//! Producers push onto a stack with one compare-and-swap on its head; the worker takes the
//! whole stack with one swap and runs it oldest first. A producer so touches one cache
//! line that the worker writes once per batch, not once per job: with a queue that the
//! consumer reads job by job, that line (and the slot's) moves between the two cores for
//! every op, which on a many-core host costs the scheduler more than the rest of a lazy
//! op's call. Taking everything at once needs no compare-and-swap on the consumer side, so
//! the stack has no ABA problem.
use std::collections::VecDeque;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

struct Node<T> {
    next: *mut Node<T>,
    item: T,
}

pub struct Queue<T> {
    head: AtomicPtr<Node<T>>,
    closed: AtomicBool,
}

// SAFETY: nodes are owned by the queue between push and take, and handed from one thread
// to another whole; items cross threads, hence `T: Send`.
unsafe impl<T: Send> Send for Queue<T> {}
unsafe impl<T: Send> Sync for Queue<T> {}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue { head: AtomicPtr::new(null_mut()), closed: AtomicBool::new(false) }
    }
}

impl<T> Queue<T> {
    /// Adds `item` (any thread).
    pub fn push(&self, item: T) {
        let node = Box::into_raw(Box::new(Node { next: null_mut(), item }));
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // SAFETY: `node` is ours until the exchange below publishes it.
            unsafe { (*node).next = head };
            match self.head.compare_exchange_weak(head, node, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Moves every item pushed so far to the back of `into`, oldest first (the consumer).
    pub fn take_into(&self, into: &mut VecDeque<T>) {
        let mut p = self.head.swap(null_mut(), Ordering::Acquire);
        let start = into.len();
        while !p.is_null() {
            // SAFETY: the swap made the whole list ours; each node was boxed by `push`.
            let node = unsafe { Box::from_raw(p) };
            p = node.next;
            into.push_back(node.item);
        }
        // The stack gave them newest first.
        into.make_contiguous()[start..].reverse();
    }

    /// Whether nothing is waiting to be taken.
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire).is_null()
    }

    /// Marks the queue closed: the producers' side is done. Pushes made before this (on
    /// any thread that synchronized with the closer) are seen by a `take_into` after the
    /// consumer sees `is_closed`.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

impl<T> Drop for Queue<T> {
    fn drop(&mut self) {
        let mut rest = VecDeque::new();
        self.take_into(&mut rest);
    }
}
