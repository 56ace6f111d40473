//! The client side of the interoperability cells and the server's echo
//! loop: the same cells, sizes and byte patterns as the Go package
//! interop/internal/cells, so that either side can check the other.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use shmipc::{compact::StreamExt, stream::Stream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Opens a stream on the client's session manager.
pub type Opener = Arc<dyn Fn() -> Result<Stream, shmipc::Error> + Send + Sync>;
/// Closes the client's session manager.
pub type Closer = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Bounds every read of an echo, so that a lost wake-up fails a cell.
const READ_TIMEOUT: Duration = Duration::from_secs(15);
/// Larger than the 1 MiB region of the cells that force fallback data.
const FALLBACK_SIZE: usize = 3 << 19;
const SIZES: [usize; 17] = [
    1,
    2,
    3,
    100,
    4092,
    4096,
    8168,
    8192,
    32744,
    65536,
    131048,
    300000,
    1 << 20,
    4 << 20,
    17 << 20,
    33 << 20,
    40 << 20,
];

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            (i.wrapping_add(seed * 131)
                .wrapping_add(i >> 8)
                .wrapping_add(i >> 16)) as u8
        })
        .collect()
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf29ce484222325)
    }
    fn write(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ x as u64).wrapping_mul(0x100000001b3);
        }
    }
}

/// Reads until buf is full or the stream ends; returns the bytes read.
async fn read_full(
    s: &mut StreamExt,
    buf: &mut [u8],
    limit: Option<Duration>,
) -> Result<usize, String> {
    let mut got = 0;
    while got < buf.len() {
        let read = s.read(&mut buf[got..]);
        let n = match limit {
            Some(d) => tokio::time::timeout(d, read)
                .await
                .map_err(|_| format!("no data for {d:?} after {got} bytes"))?,
            None => read.await,
        }
        .map_err(|e| format!("read after {got} bytes: {e}"))?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

async fn send(s: &mut StreamExt, data: &[u8]) -> Result<(), String> {
    s.write_all(data)
        .await
        .map_err(|e| format!("write {} bytes: {e}", data.len()))?;
    s.flush()
        .await
        .map_err(|e| format!("flush {} bytes: {e}", data.len()))
}

async fn expect_echo(s: &mut StreamExt, f: &[u8]) -> Result<(), String> {
    let mut got = vec![0u8; f.len()];
    let n = read_full(s, &mut got, Some(READ_TIMEOUT)).await?;
    if n < f.len() {
        return Err(format!(
            "echo of a {}-byte frame: end of stream after {n} bytes",
            f.len() - 4
        ));
    }
    if got != f {
        return Err(format!(
            "echo of a {}-byte frame differs from what was sent",
            f.len() - 4
        ));
    }
    Ok(())
}

async fn round_trip(s: &mut StreamExt, payload: &[u8]) -> Result<(), String> {
    let f = frame(payload);
    send(s, &f).await?;
    expect_echo(s, &f).await
}

async fn expect_end(s: &mut StreamExt) -> Result<(), String> {
    let mut b = [0u8; 1];
    match read_full(s, &mut b, Some(READ_TIMEOUT)).await? {
        0 => Ok(()),
        _ => Err("a byte after the last echo, want end of stream".into()),
    }
}

fn open_stream(open: &Opener) -> Result<StreamExt, String> {
    open().map(StreamExt::new).map_err(|e| format!("open: {e}"))
}

async fn close(s: StreamExt) -> Result<(), String> {
    s.into_inner()
        .close()
        .await
        .map_err(|e| format!("close: {e}"))
}

/// Serves the echo contract on one stream and returns its End line. After
/// a failed write (the client closed the stream) it goes on reading, so that
/// the line counts every byte the client sent.
pub async fn echo(stream: Stream) -> String {
    let mut e = Echo {
        s: StreamExt::new(stream),
        h: Fnv::new(),
        total: 0,
        write_ok: true,
    };
    let how = match e.frames().await {
        Ok(how) => how.to_string(),
        Err(err) => format!("error: {err}"),
    };
    let _ = e.s.into_inner().close().await;
    format!("end {how} bytes={} fnv={:016x}", e.total, e.h.0)
}

struct Echo {
    s: StreamExt,
    h: Fnv,
    total: u64,
    write_ok: bool,
}

impl Echo {
    /// Reads up to buf.len() bytes, counting and hashing them.
    async fn read(&mut self, buf: &mut [u8]) -> Result<usize, String> {
        let n = read_full(&mut self.s, buf, None).await?;
        self.total += n as u64;
        self.h.write(&buf[..n]);
        Ok(n)
    }

    async fn write(&mut self, data: &[u8]) {
        if self.write_ok {
            self.write_ok = send(&mut self.s, data).await.is_ok();
        }
    }

    async fn frames(&mut self) -> Result<&'static str, String> {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut head = [0u8; 4];
            match self.read(&mut head).await? {
                0 => return Ok("eof"),
                4 => {}
                _ => return Err("end of stream inside a frame header".into()),
            }
            self.write(&head).await;
            let mut left = u32::from_be_bytes(head) as usize;
            if left == 0 {
                return Ok("zero");
            }
            while left > 0 {
                let want = left.min(buf.len());
                let n = self.read(&mut buf[..want]).await?;
                if n < want {
                    return Err("end of stream inside a frame".into());
                }
                self.write(&buf[..n]).await;
                left -= n;
            }
        }
    }
}

/// Runs one cell with streams from open.
pub async fn run(cell: &str, open: Opener, duration: Duration) -> Result<(), String> {
    match cell {
        "sizes" => sizes(&open).await,
        "concurrent" => concurrent(&open, 16, 20).await,
        "sessions" => concurrent(&open, 64, 5).await,
        "sequential" => sequential(&open, 1000).await,
        "closeorder" => {
            close_after_fallback(&open).await?;
            let (n, fnv) = close_after_send(&open).await?;
            println!("sent bytes={n} fnv={fnv:016x}");
            Ok(())
        }
        "soak" => soak(open, duration).await,
        "traffic" => soak(open, Duration::from_secs(3600)).await,
        _ => Err(format!("unknown cell {cell}")),
    }
}

async fn one_round_trip(open: &Opener, payload: &[u8]) -> Result<(), String> {
    let mut s = open_stream(open)?;
    round_trip(&mut s, payload).await?;
    close(s).await
}

async fn sizes(open: &Opener) -> Result<(), String> {
    for (i, &n) in SIZES.iter().enumerate() {
        one_round_trip(open, &pattern(n, i))
            .await
            .map_err(|e| format!("size {n}: {e}"))?;
    }
    let mut s = open_stream(open)?;
    round_trip(&mut s, &[])
        .await
        .map_err(|e| format!("zero-length frame: {e}"))?;
    expect_end(&mut s)
        .await
        .map_err(|e| format!("zero-length frame: {e}"))?;
    close(s).await
}

async fn stream_rounds(open: Opener, st: usize, rounds: usize) -> Result<(), String> {
    let mut s = open_stream(&open)?;
    for r in 0..rounds {
        let n = 1 + (st * 7919 + r * 104729) % (300 << 10);
        round_trip(&mut s, &pattern(n, st * rounds + r))
            .await
            .map_err(|e| format!("stream {st} round {r}: {e}"))?;
    }
    close(s).await
}

async fn concurrent(open: &Opener, streams: usize, rounds: usize) -> Result<(), String> {
    let tasks: Vec<_> = (0..streams)
        .map(|st| tokio::spawn(stream_rounds(open.clone(), st, rounds)))
        .collect();
    let mut errs = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.map_err(|e| e.to_string()).and_then(|r| r) {
            errs.push(e);
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}

async fn sequential(open: &Opener, n: usize) -> Result<(), String> {
    for i in 0..n {
        one_round_trip(open, &pattern(64 + i % 512, i))
            .await
            .map_err(|e| format!("stream {} of {n}: {e}", i + 1))?;
    }
    Ok(())
}

/// The server's last bytes as fallback data, then its close: every byte,
/// then end of stream.
async fn close_after_fallback(open: &Opener) -> Result<(), String> {
    let mut s = open_stream(open)?;
    let big = frame(&pattern(FALLBACK_SIZE, 77));
    let zero = frame(&[]);
    send(&mut s, &big).await?;
    send(&mut s, &zero).await?;
    expect_echo(&mut s, &big).await?;
    expect_echo(&mut s, &zero)
        .await
        .map_err(|e| format!("zero-length frame: {e}"))?;
    expect_end(&mut s).await?;
    close(s).await
}

/// Our last bytes as fallback data, then our close, without reading the
/// echoes; returns the length and hash of what was sent.
async fn close_after_send(open: &Opener) -> Result<(u64, u64), String> {
    let mut s = open_stream(open)?;
    let mut h = Fnv::new();
    let mut n = 0u64;
    for (i, size) in [100, 5000, FALLBACK_SIZE].into_iter().enumerate() {
        let f = frame(&pattern(size, 90 + i));
        send(&mut s, &f).await?;
        h.write(&f);
        n += f.len() as u64;
    }
    close(s).await?;
    Ok((n, h.0))
}

/// Four workers open streams and make round trips until the time is up;
/// odd workers send frames too large for the 1 MiB region (fallback data).
async fn soak(open: Opener, duration: Duration) -> Result<(), String> {
    let deadline = Instant::now() + duration;
    let failed = Arc::new(AtomicBool::new(false));
    let trips = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..4usize {
        let (open, failed, trips) = (open.clone(), failed.clone(), trips.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0usize;
            while Instant::now() < deadline && !failed.load(Ordering::SeqCst) {
                let r = soak_stream(&open, w, i, &trips).await;
                if let Err(e) = r {
                    failed.store(true, Ordering::SeqCst);
                    return Err(format!("worker {w}, stream {i}: {e}"));
                }
                i += 1;
            }
            Ok(())
        }));
    }
    let mut errs = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.map_err(|e| e.to_string()).and_then(|r| r) {
            errs.push(e);
        }
    }
    println!("soak: {} round trips", trips.load(Ordering::SeqCst));
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}

async fn soak_stream(open: &Opener, w: usize, i: usize, trips: &AtomicU64) -> Result<(), String> {
    let mut s = open_stream(open)?;
    for r in 0..4 {
        let n = if w % 2 == 1 {
            FALLBACK_SIZE - r
        } else {
            1 + (w * 131 + i * 31 + r * 7) % 4000
        };
        round_trip(&mut s, &pattern(n, w + i + r)).await?;
        trips.fetch_add(1, Ordering::SeqCst);
    }
    close(s).await
}
