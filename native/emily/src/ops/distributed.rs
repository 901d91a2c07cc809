//! Collectives (`optable/distributed.ops`): the generated op NIFs, and the group NIFs.
//!
//! Joining a group blocks until every rank has joined (MLX's ring backend accepts and
//! connects without a deadline), so it runs on a thread of its own, never on a worker
//! or a scheduler, and the caller gets an error once `join_timeout_ms` has passed. A
//! join that is given up on is then unblocked: the ring backend waits in `accept` on
//! this rank's own address, so a connection to it lets the join go on and fail (or
//! finish, and be released); its thread ends within MLX's connect retries (about 30 s).
use crate::bridge::ffi;
use crate::error::{argument_error, Error};
use crate::tensor::Reply;
use rustler::{Env, NifResult, Term};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::Duration;

include!(concat!(env!("OUT_DIR"), "/nifs_distributed.rs"));

fn join_error(message: String) -> Error {
    Error::Mlx { op: "distributed_init".into(), message, inputs: "none".into() }
}

/// `distributed_init(ref, backend, rank, size, hostfile, coordinator, timeout_ms,
/// join_timeout_ms, own_address)`: replies `{ref, {:ok, group_id}}` or `{ref, {:error,
/// e}}`. `own_address` ("ip:port", or "") is this rank's listening address, connected to
/// when the join is given up on.
#[rustler::nif]
#[allow(clippy::too_many_arguments)]
fn distributed_init<'a>(
    env: Env<'a>,
    reference: Term<'a>,
    backend: String,
    rank: i64,
    size: i64,
    hostfile: String,
    coordinator: String,
    timeout_ms: i64,
    join_timeout_ms: i64,
    own_address: String,
) -> NifResult<Term<'a>> {
    let (Ok(rank), Ok(size)) = (i32::try_from(rank), i32::try_from(size)) else {
        return Err(argument_error(format!("distributed_init: rank {rank} or size {size} out of range")));
    };
    if join_timeout_ms <= 0 || timeout_ms < 0 {
        return Err(argument_error("distributed_init: timeouts must be positive"));
    }
    let reply = Reply::new(env, reference);
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("emily-dist-join".into())
        .spawn(move || {
            let res = ffi::distributed_init(&backend, rank, size, &hostfile, &coordinator, timeout_ms);
            if let Err(Ok(id)) = tx.send(res.map_err(|e| e.what().to_string())).map_err(|e| e.0) {
                // Given up on, but joined after all: nobody holds the group.
                ffi::distributed_release(id);
            }
        })
        .map_err(|e| argument_error(format!("distributed_init: cannot start a thread: {e}")))?;
    std::thread::Builder::new()
        .name("emily-dist-wait".into())
        .spawn(move || {
            let deadline = Duration::from_millis(join_timeout_ms as u64);
            match rx.recv_timeout(deadline) {
                Ok(Ok(id)) => reply.send_result(Ok(id)),
                Ok(Err(e)) => reply.send_result::<i64>(Err(join_error(e))),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    reply.send_result::<i64>(Err(join_error("the join thread stopped".into())))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    reply.send_result::<i64>(Err(join_error(format!(
                        "not every rank joined within {join_timeout_ms} ms"
                    ))));
                    unblock(&own_address, rx);
                }
            }
        })
        .map_err(|e| argument_error(format!("distributed_init: cannot start a thread: {e}")))?;
    Ok(reference)
}

/// Connects to `own_address` until the abandoned join ends (its result is dropped, or
/// released by the join thread).
fn unblock(own_address: &str, rx: mpsc::Receiver<Result<i64, String>>) {
    let addr = own_address.to_socket_addrs().ok().and_then(|mut a| a.next());
    loop {
        if let Some(addr) = addr {
            // Dropped at once: the join reads from it, fails or goes on, and ends.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        }
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(id)) => return ffi::distributed_release(id),
            Ok(Err(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

/// `distributed_release(group)`: forgets the group; its connections close once no
/// pending op holds it. `:ok`.
#[rustler::nif]
fn distributed_release(group: i64) -> rustler::Atom {
    ffi::distributed_release(group);
    crate::atoms::ok()
}

/// `distributed_available(backend)`: whether this libmlx has `backend` ("ring", "mpi",
/// "nccl", "jaccl").
#[rustler::nif]
fn distributed_available(backend: String) -> NifResult<bool> {
    ffi::distributed_available(&backend)
        .map_err(|e| argument_error(format!("distributed_available: {}", e.what())))
}
