//! The rendezvous store: a TCP key-value store served by rank 0, like torch's c10d TCPStore.
//! Clients present the job token first; a client with another token is turned away, so a stray
//! process on the network cannot join (or disturb) a job. Every blocking call has a timeout.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The environment variable carrying the per-job token (set by `cargo trl launch`).
pub const TOKEN_VAR: &str = "TRL_JOB_TOKEN";

/// The descriptor of a listening socket rank 0 inherits and serves the store on, set by a
/// launcher that picked the port (`--main_process_port 0`): it bound the port itself and
/// keeps it, so no other job can take it between the choice and rank 0's start.
pub const LISTEN_FD_VAR: &str = "TRL_STORE_LISTEN_FD";
const MAGIC: &[u8; 8] = b"TRLSTOR1";
const MAX_FRAME: usize = 64 << 20;

#[repr(u8)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Set = 1,
    Get = 2,
    Add = 3,
    Wait = 4,
    Delete = 5,
    Check = 6,
}

#[repr(u8)]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok = 0,
    Timeout = 1,
    Error = 2,
}

// ---- framing: [u32 length][payload], payload fields length-prefixed ----

fn write_frame(w: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn read_frame(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "frame too large",
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as usize;
        self.take(n)
    }
    fn string(&mut self) -> Option<String> {
        self.bytes()
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

// ---- server ----

#[derive(Default)]
struct State {
    data: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl State {
    /// Waits until every key exists or the deadline passes; returns whether they all exist.
    fn wait_for(&self, keys: &[String], timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut data = self.data.lock().unwrap();
        loop {
            if keys.iter().all(|k| data.contains_key(k)) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            data = self.changed.wait_timeout(data, deadline - now).unwrap().0;
        }
    }
}

/// A running store server. It serves until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Binds exactly `addr` (never a wildcard unless asked) and serves in the background.
    pub fn bind(addr: &str, token: &str) -> Result<Self> {
        let sock = resolve(addr)?;
        let listener = TcpListener::bind(sock).map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::AddrInUse => format!(
                    "port {} is already in use (another job?): pick another with --main_process_port or MASTER_PORT",
                    sock.port()
                ),
                std::io::ErrorKind::AddrNotAvailable => format!(
                    "{} is not an address of this machine: rank 0 must run on the host named by MASTER_ADDR / main_process_ip",
                    sock.ip()
                ),
                _ => format!("cannot listen: {e}"),
            };
            Error::Store { addr: addr.to_string(), message: hint }
        })?;
        Self::serve(listener, token)
    }

    /// Serves the store on `listener` in the background.
    pub fn serve(listener: TcpListener, token: &str) -> Result<Self> {
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("store listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(State::default());
        let token = token.to_string();
        let stop2 = stop.clone();
        thread::Builder::new()
            .name("trl-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    let token = token.clone();
                    let _ = thread::Builder::new()
                        .name("trl-store-conn".into())
                        .spawn(move || serve_client(conn, &state, &token));
                }
            })
            .map_err(|e| Error::io("spawn store thread", e))?;
        Ok(StoreServer { addr: local, stop })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// The listening socket the launcher handed down ([`LISTEN_FD_VAR`]), if any.
fn inherited_listener(addr: &str) -> Result<Option<TcpListener>> {
    let Ok(var) = std::env::var(LISTEN_FD_VAR) else {
        return Ok(None);
    };
    let fail = |message: String| Error::Store {
        addr: addr.to_string(),
        message,
    };
    let fd: std::os::fd::RawFd = var
        .trim()
        .parse()
        .map_err(|_| fail(format!("{LISTEN_FD_VAR}={var} is not a descriptor number")))?;
    // SAFETY: fstat only writes the struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(fail(format!(
            "{LISTEN_FD_VAR}={fd} is not an open socket of this process: start ranks with cargo trl launch, or unset it"
        )));
    }
    // SAFETY: an open socket the launcher created for this process to own.
    Ok(Some(unsafe {
        <TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd)
    }))
}

fn serve_client(mut conn: TcpStream, state: &State, token: &str) {
    let _ = conn.set_nodelay(true);
    // The hello must come quickly; requests after it may wait as long as clients ask.
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(hello) = read_frame(&mut conn) else {
        return;
    };
    let mut r = Reader(&hello);
    let ok = r.take(8) == Some(MAGIC.as_slice()) && r.string().as_deref() == Some(token);
    if !ok {
        let msg = "job token mismatch: this store belongs to another job (TRL_JOB_TOKEN differs)";
        let _ = write_frame(
            &mut conn,
            &Writer::default()
                .u8(Status::Error as u8)
                .bytes(msg.as_bytes())
                .0,
        );
        let _ = conn.shutdown(Shutdown::Both);
        return;
    }
    if write_frame(&mut conn, &[Status::Ok as u8]).is_err() {
        return;
    }
    let _ = conn.set_read_timeout(None);
    while let Ok(req) = read_frame(&mut conn) {
        let reply = handle(&req, state).unwrap_or_else(|| {
            Writer::default()
                .u8(Status::Error as u8)
                .bytes(b"malformed request")
                .0
        });
        if write_frame(&mut conn, &reply).is_err() {
            return;
        }
    }
}

fn handle(req: &[u8], state: &State) -> Option<Vec<u8>> {
    let mut r = Reader(req);
    let op = r.u8()?;
    let ok = Writer::default().u8(Status::Ok as u8);
    Some(match op {
        x if x == Op::Set as u8 => {
            let key = r.string()?;
            let value = r.bytes()?.to_vec();
            state.data.lock().unwrap().insert(key, value);
            state.changed.notify_all();
            ok.0
        }
        x if x == Op::Get as u8 => {
            let key = r.string()?;
            let timeout = Duration::from_millis(r.u64()?);
            if state.wait_for(std::slice::from_ref(&key), timeout) {
                let v = state
                    .data
                    .lock()
                    .unwrap()
                    .get(&key)
                    .cloned()
                    .unwrap_or_default();
                ok.bytes(&v).0
            } else {
                Writer::default().u8(Status::Timeout as u8).0
            }
        }
        x if x == Op::Add as u8 => {
            let key = r.string()?;
            let delta = r.u64()? as i64;
            let mut data = state.data.lock().unwrap();
            let current = data
                .get(&key)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                .unwrap_or(0);
            let new = current + delta;
            data.insert(key, new.to_string().into_bytes());
            drop(data);
            state.changed.notify_all();
            ok.u64(new as u64).0
        }
        x if x == Op::Wait as u8 || x == Op::Check as u8 => {
            let timeout = Duration::from_millis(r.u64()?);
            let n = r.u64()? as usize;
            let keys = (0..n).map(|_| r.string()).collect::<Option<Vec<_>>>()?;
            let timeout = if x == Op::Check as u8 {
                Duration::ZERO
            } else {
                timeout
            };
            let all = state.wait_for(&keys, timeout);
            if x == Op::Check as u8 {
                ok.u8(all as u8).0
            } else if all {
                ok.0
            } else {
                Writer::default().u8(Status::Timeout as u8).0
            }
        }
        x if x == Op::Delete as u8 => {
            let key = r.string()?;
            let existed = state.data.lock().unwrap().remove(&key).is_some();
            ok.u8(existed as u8).0
        }
        _ => return None,
    })
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Store {
            addr: addr.into(),
            message: format!("cannot resolve the address: {e}"),
        })?
        .next()
        .ok_or_else(|| Error::Store {
            addr: addr.into(),
            message: "the host name resolves to no address".into(),
        })
}

// ---- client ----

/// A connection to the store. Calls are serialised; each blocking call has a timeout.
pub struct Store {
    addr: String,
    conn: Mutex<TcpStream>,
    local: SocketAddr,
    timeout: Duration,
    // Rank 0 keeps the server alive for the whole job.
    _server: Option<StoreServer>,
}

impl Store {
    /// Connects to the store at `addr`, retrying until `timeout` (rank 0 may start later).
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<Self> {
        let sock = resolve(addr)?;
        let deadline = Instant::now() + timeout;
        let mut conn = loop {
            match TcpStream::connect_timeout(&sock, Duration::from_secs(2)) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::trace!("store {addr} not reachable yet: {e}");
                    thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(Error::Store {
                        addr: addr.into(),
                        message: format!(
                            "not reachable within {timeout:?} ({e}): is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?"
                        ),
                    })
                }
            }
        };
        let _ = conn.set_nodelay(true);
        let fail = |m: String| Error::Store {
            addr: addr.into(),
            message: m,
        };
        conn.set_read_timeout(Some(Duration::from_secs(30))).ok();
        write_frame(&mut conn, &Writer(MAGIC.to_vec()).bytes(token.as_bytes()).0)
            .map_err(|e| fail(format!("handshake failed: {e}")))?;
        let reply = read_frame(&mut conn).map_err(|e| fail(format!("handshake failed: {e}")))?;
        if reply.first() != Some(&(Status::Ok as u8)) {
            let msg = Reader(&reply[1.min(reply.len())..])
                .string()
                .unwrap_or_default();
            return Err(fail(format!("rejected: {msg}")));
        }
        conn.set_read_timeout(None).ok();
        let local = conn
            .local_addr()
            .map_err(|e| Error::io("store socket", e))?;
        Ok(Store {
            addr: addr.into(),
            conn: Mutex::new(conn),
            local,
            timeout,
            _server: None,
        })
    }

    /// Rank 0 serves the store at `addr` and connects to it; the others connect.
    pub fn for_rank(rank: usize, addr: &str, token: &str, timeout: Duration) -> Result<Self> {
        if rank == 0 {
            let server = match inherited_listener(addr)? {
                Some(listener) => StoreServer::serve(listener, token)?,
                None => StoreServer::bind(addr, token)?,
            };
            let mut store = Store::connect(&server.addr().to_string(), token, timeout)?;
            store.addr = addr.to_string();
            store._server = Some(server);
            Ok(store)
        } else {
            Store::connect(addr, token, timeout)
        }
    }

    /// The token of this job from the environment (empty when not launched by cargo trl).
    pub fn token_from_env() -> String {
        std::env::var(TOKEN_VAR).unwrap_or_default()
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This machine's address as seen on the route to the store (where peers can reach us).
    pub fn local_ip(&self) -> std::net::IpAddr {
        self.local.ip()
    }

    pub fn default_timeout(&self) -> Duration {
        self.timeout
    }

    fn request(&self, payload: Vec<u8>) -> Result<Vec<u8>> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        write_frame(&mut *conn, &payload)
            .and_then(|_| read_frame(&mut *conn))
            .map_err(|e| Error::Store {
                addr: self.addr.clone(),
                message: format!(
                    "connection lost ({e}): rank 0, which serves the store, may have exited"
                ),
            })
    }

    fn status(&self, reply: &[u8], what: &str) -> Result<bool> {
        match reply.first() {
            Some(&s) if s == Status::Ok as u8 => Ok(true),
            Some(&s) if s == Status::Timeout as u8 => Ok(false),
            _ => Err(Error::Store {
                addr: self.addr.clone(),
                message: format!(
                    "{what} failed: {}",
                    Reader(&reply[1.min(reply.len())..])
                        .string()
                        .unwrap_or_default()
                ),
            }),
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let reply = self.request(
            Writer::default()
                .u8(Op::Set as u8)
                .bytes(key.as_bytes())
                .bytes(value)
                .0,
        )?;
        self.status(&reply, "set")?;
        Ok(())
    }

    /// Waits for `key` up to the default timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let reply = self.request(
            Writer::default()
                .u8(Op::Get as u8)
                .bytes(key.as_bytes())
                .u64(timeout.as_millis() as u64)
                .0,
        )?;
        if !self.status(&reply, "get")? {
            return Err(Error::Store {
                addr: self.addr.clone(),
                message: format!("key `{key}` did not appear within {timeout:?}"),
            });
        }
        Ok(Reader(&reply[1..]).bytes().unwrap_or_default().to_vec())
    }

    /// Adds `delta` to the integer at `key` (0 when absent) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let reply = self.request(
            Writer::default()
                .u8(Op::Add as u8)
                .bytes(key.as_bytes())
                .u64(delta as u64)
                .0,
        )?;
        self.status(&reply, "add")?;
        Ok(Reader(&reply[1..]).u64().unwrap_or(0) as i64)
    }

    /// Waits until all `keys` exist; false on timeout.
    pub fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool> {
        self.keys_request(Op::Wait, keys, timeout)
    }

    /// Whether all `keys` exist now.
    pub fn check(&self, keys: &[String]) -> Result<bool> {
        self.keys_request(Op::Check, keys, Duration::ZERO)
    }

    fn keys_request(&self, op: Op, keys: &[String], timeout: Duration) -> Result<bool> {
        let mut w = Writer::default()
            .u8(op as u8)
            .u64(timeout.as_millis() as u64)
            .u64(keys.len() as u64);
        for k in keys {
            w = w.bytes(k.as_bytes());
        }
        let reply = self.request(w.0)?;
        let done = self.status(&reply, "wait")?;
        Ok(if op == Op::Check {
            reply.get(1) == Some(&1)
        } else {
            done
        })
    }

    pub fn delete(&self, key: &str) -> Result<bool> {
        let reply = self.request(
            Writer::default()
                .u8(Op::Delete as u8)
                .bytes(key.as_bytes())
                .0,
        )?;
        self.status(&reply, "delete")?;
        Ok(reply.get(1) == Some(&1))
    }

    /// A barrier over the store: every rank of `world` announces itself under `name` and waits
    /// for the others; on timeout the error lists the ranks that never arrived.
    pub fn rendezvous(
        &self,
        name: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<()> {
        let key = |r: usize| format!("rdzv/{name}/{r}");
        self.set(&key(rank), b"1")?;
        let keys: Vec<String> = (0..world).map(key).collect();
        if self.wait(&keys, timeout)? {
            return Ok(());
        }
        let mut missing = Vec::new();
        for (r, k) in keys.iter().enumerate() {
            if !self.check(std::slice::from_ref(k))? {
                missing.push(r);
            }
        }
        Err(Error::RendezvousTimeout {
            name: name.into(),
            addr: self.addr.clone(),
            timeout,
            missing,
            world,
        })
    }
}
