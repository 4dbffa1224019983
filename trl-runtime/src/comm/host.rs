//! The host backend: ranks are processes (on one or several machines) connected by TCP, one
//! socket per pair of group members. Connections are set up through the rendezvous store and
//! authenticated with the job token. Peers on the same machine then move data through
//! shared-memory rings ([`super::shm`]) and keep the socket to watch each other; set
//! `TRL_HOST_SHM=0` to force TCP. A peer that dies closes its socket, so the others get an
//! error at once; a peer that hangs is reported after the timeout.

use super::ring::RingComm;
use super::shm::{ring_path, ShmRing};
use super::store::Store;
use super::transport::{mismatch, OpCode, Sent, Sink, Transport};
use super::Communicator;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"TRLCOMM1";
/// Receive granularity: large enough to amortise syscalls, small enough to reduce while the
/// kernel keeps receiving.
const CHUNK: usize = 1 << 20;
const HEADER: usize = 16;
/// Data bytes of each shared-memory ring (one per direction per peer).
pub const SHM_RING_BYTES: usize = 8 << 20;
/// Set to 0 to keep same-machine peers on TCP.
pub const SHM_VAR: &str = "TRL_HOST_SHM";

/// Creates host-backend groups for this process.
pub struct HostBackend {
    store: Arc<Store>,
    token: String,
    /// This process's rank in the world (members of groups are world ranks).
    rank: usize,
    timeout: Duration,
    use_shm: bool,
    generations: Mutex<HashMap<String, usize>>,
}

/// Shared-memory rings to a peer on this machine; the socket stays as a liveness probe.
struct ShmLink {
    tx: ShmRing,
    rx: ShmRing,
    probe: TcpStream,
}

struct Peer {
    reader: Mutex<TcpStream>,
    writer: Mutex<TcpStream>,
    shm: Option<ShmLink>,
}

/// Whether the peer behind `probe` still holds its end open (EOF means it exited).
fn peer_alive(probe: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: a non-blocking peek of one byte into a valid buffer.
    let n = unsafe {
        libc::recv(
            probe.as_raw_fd(),
            &mut byte as *mut u8 as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return false;
    }
    n > 0 || std::io::Error::last_os_error().kind() == ErrorKind::WouldBlock
}

fn header_bytes(op: OpCode, len: usize) -> [u8; HEADER] {
    let mut header = [0u8; HEADER];
    header[..4].copy_from_slice(&(op as u32).to_le_bytes());
    header[8..].copy_from_slice(&(len as u64).to_le_bytes());
    header
}

fn parse_header(header: &[u8; HEADER]) -> (u32, usize) {
    (
        u32::from_le_bytes(header[..4].try_into().unwrap()),
        u64::from_le_bytes(header[8..].try_into().unwrap()) as usize,
    )
}

/// Bytes that pad a message to a multiple of 8 in a ring.
fn padding(len: usize) -> usize {
    (8 - len % 8) % 8
}

struct TcpTransport {
    rank: usize,
    size: usize,
    /// Global ranks of the members, for messages.
    members: Vec<usize>,
    peers: Vec<Option<Peer>>,
    timeout: Duration,
}

fn io_message(e: &std::io::Error, peer_global: usize, timeout: Duration, doing: &str) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            format!("rank {peer_global} closed its connection while we were {doing}: it exited or crashed (see its log)")
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
            "no data from rank {peer_global} for {timeout:?} while {doing}: it may be hung or running a different collective"
        ),
        _ => format!("socket error with rank {peer_global} while {doing}: {e}"),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "host"
    }
    fn send_may_block(&self) -> bool {
        true
    }

    fn send(&self, peer: usize, op: OpCode, data: &[u8]) -> Sent {
        let p = self.peers[peer].as_ref().ok_or("cannot send to self")?;
        let mut w = p.writer.lock().unwrap_or_else(|e| e.into_inner());
        let header = header_bytes(op, data.len());
        if let Some(link) = &p.shm {
            let mut check = self.watchdog(&link.probe, self.members[peer], "sending");
            link.tx.write(&header, &mut check)?;
            link.tx.write(data, &mut check)?;
            return link.tx.write(&[0u8; 8][..padding(data.len())], &mut check);
        }
        let result = if data.len() <= 64 << 10 {
            // One write for small messages (header + payload) keeps latency down.
            let mut msg = Vec::with_capacity(HEADER + data.len());
            msg.extend_from_slice(&header);
            msg.extend_from_slice(data);
            w.write_all(&msg)
        } else {
            w.write_all(&header).and_then(|_| w.write_all(data))
        };
        result.map_err(|e| io_message(&e, self.members[peer], self.timeout, "sending"))
    }

    fn recv(&self, peer: usize, op: OpCode, len: usize, sink: &mut Sink<'_>) -> Sent {
        let p = self.peers[peer]
            .as_ref()
            .ok_or("cannot receive from self")?;
        let mut r = p.reader.lock().unwrap_or_else(|e| e.into_inner());
        let global = self.members[peer];
        let mut header = [0u8; HEADER];
        if let Some(link) = &p.shm {
            let mut check = self.watchdog(&link.probe, global, "waiting for its message");
            link.rx.read(
                HEADER,
                &mut |o, b| header[o..o + b.len()].copy_from_slice(b),
                &mut check,
            )?;
            let (got_op, got_len) = parse_header(&header);
            if got_op != op as u32 || got_len != len {
                return Err(mismatch(global, op, len, got_op, got_len));
            }
            link.rx.read(len, sink, &mut check)?;
            return link.rx.read(padding(len), &mut |_, _| {}, &mut check);
        }
        r.read_exact(&mut header)
            .map_err(|e| io_message(&e, global, self.timeout, "waiting for its message"))?;
        let (got_op, got_len) = parse_header(&header);
        if got_op != op as u32 || got_len != len {
            return Err(mismatch(global, op, len, got_op, got_len));
        }
        // u64 backing keeps the chunk 8-byte aligned, so elements can be read in place.
        let mut scratch = vec![0u64; CHUNK.min(len).div_ceil(8)];
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch);
        let mut offset = 0;
        while offset < len {
            let n = CHUNK.min(len - offset);
            r.read_exact(&mut scratch[..n])
                .map_err(|e| io_message(&e, global, self.timeout, "receiving its data"))?;
            sink(offset, &scratch[..n]);
            offset += n;
        }
        Ok(())
    }
}

impl TcpTransport {
    /// A check for ring waits: fails when the peer's socket closed or after the timeout.
    fn watchdog<'a>(
        &self,
        probe: &'a TcpStream,
        peer_global: usize,
        doing: &'static str,
    ) -> impl FnMut() -> std::result::Result<(), String> + 'a {
        let start = Instant::now();
        let timeout = self.timeout;
        move || {
            if !peer_alive(probe) {
                return Err(format!(
                    "rank {peer_global} closed its connection while we were {doing}: it exited or crashed (see its log)"
                ));
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "no data from rank {peer_global} for {timeout:?} while {doing}: it may be hung or running a different collective"
                ));
            }
            Ok(())
        }
    }
}

fn configure(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(())
}

impl HostBackend {
    /// `rank` is this process's world rank; `timeout` bounds every wait on a peer.
    pub fn new(
        store: Arc<Store>,
        token: impl Into<String>,
        rank: usize,
        timeout: Duration,
    ) -> Self {
        HostBackend {
            store,
            token: token.into(),
            rank,
            timeout,
            use_shm: std::env::var(SHM_VAR)
                .map(|v| v.trim() != "0")
                .unwrap_or(true),
            generations: Mutex::new(HashMap::new()),
        }
    }

    /// A backend for the same process and store that uses shared memory with same-machine
    /// peers or not (default: yes unless TRL_HOST_SHM=0).
    pub fn clone_with_shared_memory(&self, enabled: bool) -> Self {
        HostBackend {
            store: self.store.clone(),
            token: self.token.clone(),
            rank: self.rank,
            timeout: self.timeout,
            use_shm: enabled,
            generations: Mutex::new(self.generations.lock().unwrap().clone()),
        }
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Connects this process to the other `members` (world ranks, in group order) of the group
    /// `name`. Every member must call this with the same name and members.
    pub fn group(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        let fail = |m: String| Error::Comm {
            op: "new_group",
            group: name.into(),
            rank: self.rank,
            message: m,
        };
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| fail(format!("rank {} is not a member of {members:?}", self.rank)))?;
        let generation = {
            let mut g = self.generations.lock().unwrap();
            let e = g.entry(name.to_string()).or_insert(0);
            *e += 1;
            *e
        };
        let key = format!("comm/{name}/{members:?}/{generation}");
        let n = members.len();
        let mut peers: Vec<Option<Peer>> = (0..n).map(|_| None).collect();
        if n > 1 {
            let listener = TcpListener::bind((self.store.local_ip(), 0))
                .map_err(|e| fail(format!("cannot listen for peers: {e}")))?;
            let addr = listener.local_addr().map_err(|e| fail(e.to_string()))?;
            self.store
                .set(&format!("{key}/addr/{me}"), addr.to_string().as_bytes())?;
            let deadline = Instant::now() + self.timeout;
            // Lower members accept, higher members connect: each pair gets exactly one socket.
            for (j, peer) in peers.iter_mut().enumerate().take(me) {
                let text = self
                    .store
                    .get_timeout(&format!("{key}/addr/{j}"), self.timeout)?;
                let peer_addr: SocketAddr = String::from_utf8_lossy(&text)
                    .parse()
                    .map_err(|e| fail(format!("bad address from rank {}: {e}", members[j])))?;
                let mut stream = connect_until(peer_addr, deadline).map_err(|e| {
                    fail(format!(
                        "cannot connect to rank {} at {peer_addr}: {e}",
                        members[j]
                    ))
                })?;
                let mut hello = MAGIC.to_vec();
                for field in [self.token.as_bytes(), key.as_bytes()] {
                    hello.extend_from_slice(&(field.len() as u32).to_le_bytes());
                    hello.extend_from_slice(field);
                }
                hello.extend_from_slice(&(me as u32).to_le_bytes());
                stream
                    .write_all(&hello)
                    .map_err(|e| fail(format!("handshake with rank {}: {e}", members[j])))?;
                configure(&stream, self.timeout).map_err(|e| fail(e.to_string()))?;
                let shm = accept_shm_offer(&mut stream).map_err(|e| {
                    fail(format!(
                        "rank {} refused the connection ({e}): does it run with the same TRL_JOB_TOKEN?",
                        members[j]
                    ))
                })?;
                *peer =
                    Some(make_peer(stream, self.timeout, shm).map_err(|e| fail(e.to_string()))?);
            }
            let mut waiting = n - 1 - me;
            listener
                .set_nonblocking(true)
                .map_err(|e| fail(e.to_string()))?;
            while waiting > 0 {
                match listener.accept() {
                    Ok((stream, from)) => {
                        stream.set_nonblocking(false).ok();
                        match self.read_hello(&stream, &key, n) {
                            Ok(j) if j > me && peers[j].is_none() => {
                                configure(&stream, self.timeout).map_err(|e| fail(e.to_string()))?;
                                let shm = self
                                    .offer_shm(&stream, me, j)
                                    .map_err(|e| fail(format!("handshake with rank {}: {e}", members[j])))?;
                                peers[j] = Some(make_peer(stream, self.timeout, shm).map_err(|e| fail(e.to_string()))?);
                                waiting -= 1;
                            }
                            Ok(j) => tracing::warn!("group {name}: duplicate or unexpected connection from member {j} ({from}): dropped"),
                            Err(why) => tracing::warn!("group {name}: rejected a connection from {from}: {why}"),
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<usize> = (me + 1..n)
                                .filter(|&j| peers[j].is_none())
                                .map(|j| members[j])
                                .collect();
                            return Err(fail(format!(
                                "rank(s) {missing:?} did not connect within {:?}: were they launched, and can they reach {addr}?",
                                self.timeout
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => return Err(fail(format!("accept failed: {e}"))),
                }
            }
        }
        let transport = TcpTransport {
            rank: me,
            size: n,
            members: members.to_vec(),
            peers,
            timeout: self.timeout,
        };
        Ok(Arc::new(RingComm::new(
            transport,
            format!("{name}{members:?}"),
        )))
    }

    /// Validates a peer's hello (job token, group) and returns its member index.
    fn read_hello(
        &self,
        mut stream: &TcpStream,
        key: &str,
        n: usize,
    ) -> std::result::Result<usize, String> {
        stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let mut magic = [0u8; 8];
        stream.read_exact(&mut magic).map_err(|e| e.to_string())?;
        if &magic != MAGIC {
            return Err("not a cargo-trl peer".into());
        }
        let mut field = || -> std::result::Result<Vec<u8>, String> {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).map_err(|e| e.to_string())?;
            let len = u32::from_le_bytes(len) as usize;
            if len > 4096 {
                return Err("oversized handshake".into());
            }
            let mut buf = vec![0u8; len];
            stream.read_exact(&mut buf).map_err(|e| e.to_string())?;
            Ok(buf)
        };
        if field()? != self.token.as_bytes() {
            return Err("wrong job token".into());
        }
        if field()? != key.as_bytes() {
            return Err("it belongs to another group".into());
        }
        let mut idx = [0u8; 4];
        stream.read_exact(&mut idx).map_err(|e| e.to_string())?;
        let idx = u32::from_le_bytes(idx) as usize;
        if idx >= n {
            return Err(format!("member index {idx} out of range"));
        }
        Ok(idx)
    }
}

fn connect_until(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn make_peer(
    stream: TcpStream,
    timeout: Duration,
    shm: Option<(ShmRing, ShmRing)>,
) -> std::io::Result<Peer> {
    configure(&stream, timeout)?;
    let writer = stream.try_clone()?;
    let shm = match shm {
        Some((tx, rx)) => Some(ShmLink {
            tx,
            rx,
            probe: stream.try_clone()?,
        }),
        None => None,
    };
    Ok(Peer {
        reader: Mutex::new(stream),
        writer: Mutex::new(writer),
        shm,
    })
}

fn write_field(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u32).to_le_bytes());
    out.extend_from_slice(field);
}

fn read_field(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 4096 {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "oversized handshake field",
        ));
    }
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

/// Connector side: reads the acceptor's offer of two ring files and maps them if this machine
/// can see them (same host). Returns (tx, rx) rings, or None for TCP.
fn accept_shm_offer(stream: &mut TcpStream) -> std::io::Result<Option<(ShmRing, ShmRing)>> {
    let mut flag = [0u8; 1];
    stream.read_exact(&mut flag)?;
    if flag[0] == 0 {
        return Ok(None);
    }
    let to_us = read_field(stream)?;
    let to_them = read_field(stream)?;
    let path = |b: Vec<u8>| std::path::PathBuf::from(String::from_utf8_lossy(&b).into_owned());
    let rings = ShmRing::open(&path(to_them)).and_then(|tx| Ok((tx, ShmRing::open(&path(to_us))?)));
    stream.write_all(&[rings.is_ok() as u8])?;
    Ok(rings.ok())
}

impl HostBackend {
    /// Acceptor side: creates the two rings of the pair, offers them, and unlinks the files
    /// once the peer answered (mapped or not), so nothing is left in /dev/shm.
    fn offer_shm(
        &self,
        mut stream: &TcpStream,
        me: usize,
        peer: usize,
    ) -> std::io::Result<Option<(ShmRing, ShmRing)>> {
        let created = if self.use_shm {
            let (a, b) = (
                ring_path(&format!("{me}to{peer}")),
                ring_path(&format!("{peer}to{me}")),
            );
            match ShmRing::create(&a, SHM_RING_BYTES)
                .and_then(|tx| Ok((tx, ShmRing::create(&b, SHM_RING_BYTES)?)))
            {
                Ok(rings) => Some((rings, a, b)),
                Err(e) => {
                    tracing::debug!("shared memory unavailable ({e}); using TCP");
                    let _ = std::fs::remove_file(&a);
                    None
                }
            }
        } else {
            None
        };
        let Some((rings, a, b)) = created else {
            stream.write_all(&[0])?;
            return Ok(None);
        };
        let mut offer = vec![1u8];
        write_field(&mut offer, a.to_string_lossy().as_bytes());
        write_field(&mut offer, b.to_string_lossy().as_bytes());
        let answer = stream.write_all(&offer).and_then(|_| {
            let mut ok = [0u8; 1];
            stream.read_exact(&mut ok).map(|_| ok[0] == 1)
        });
        let _ = std::fs::remove_file(&a);
        let _ = std::fs::remove_file(&b);
        Ok(if answer? { Some(rings) } else { None })
    }
}
