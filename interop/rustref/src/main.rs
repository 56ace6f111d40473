//! rustref is an echo server and client built on CloudWeGo's Rust
//! implementation of Shmipc (the `shmipc` crate), for the interoperability
//! tests of the Go module beside it. It follows the echo contract of the
//! Shmipc conformance kit and takes the same flags as goref:
//!
//!   rustref -server -addr unix:/tmp/s.sock        (or tcp:127.0.0.1:PORT)
//!   rustref -client -addr unix:/tmp/s.sock -mode memfd -prefix /dev/shm/x -cell sizes
//!
//! The server prints "listening" once it accepts connections, and one line
//! per stream that ends: "end eof|zero|error: ... bytes=N fnv=HEX". The
//! client runs one cell, prints "PASS cell" or "FAIL cell: reason" and exits
//! 0 only if the cell passed. Run it with SHMIPC_DEBUG_MODE set: otherwise
//! the crate refuses to open streams for 30 s after fallback data.

mod cells;

use std::{process::exit, sync::Arc, time::Duration};

use shmipc::{
    config::Config,
    consts::MemMapType,
    session::{SessionManager, SessionManagerConfig},
    transport::{DefaultTcpConnect, DefaultTcpListen, DefaultUnixConnect, DefaultUnixListen},
    Listener,
};

use cells::{echo, Opener};

struct Args {
    server: bool,
    client: bool,
    addr: String,
    mode: String,
    prefix: String,
    cell: String,
    duration: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        server: false,
        client: false,
        addr: String::new(),
        mode: "memfd".into(),
        prefix: "/dev/shm/shmipc".into(),
        cell: String::new(),
        duration: Duration::from_secs(20),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.trim_start_matches('-') {
            "server" => a.server = true,
            "client" => a.client = true,
            "addr" => a.addr = value()?,
            "mode" => a.mode = value()?,
            "prefix" => a.prefix = value()?,
            "cell" => a.cell = value()?,
            "duration" => {
                let v = value()?;
                let secs: u64 = v
                    .trim_end_matches('s')
                    .parse()
                    .map_err(|_| format!("bad -duration {v}"))?;
                a.duration = Duration::from_secs(secs);
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.server == a.client || !(a.addr.starts_with("unix:") || a.addr.starts_with("tcp:")) {
        return Err("usage: rustref -server|-client -addr unix:PATH|tcp:HOST:PORT [-mode memfd|file -prefix P -cell NAME]".into());
    }
    Ok(a)
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            exit(2);
        }
    };
    if args.server {
        if let Err(e) = serve(&args.addr).await {
            eprintln!("server: {e}");
            exit(1);
        }
        return;
    }
    match run_cell(&args).await {
        Ok(()) => println!("PASS {}", args.cell),
        Err(e) => {
            println!("FAIL {}: {e}", args.cell);
            exit(1);
        }
    }
}

async fn serve(addr: &str) -> Result<(), String> {
    let config = Config::new();
    let mut listener = if let Some(path) = addr.strip_prefix("unix:") {
        let sa = std::os::unix::net::SocketAddr::from_pathname(path).map_err(|e| e.to_string())?;
        Listener::new(DefaultUnixListen, sa, config).await
    } else {
        let sa: std::net::SocketAddr = addr["tcp:".len()..].parse().map_err(|e| format!("{e}"))?;
        Listener::new(DefaultTcpListen, sa, config).await
    }
    .map_err(|e| e.to_string())?;
    println!("listening {addr}");
    loop {
        let stream = listener.accept().await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let end = echo(stream).await;
            println!("{end}");
        });
    }
}

async fn run_cell(a: &Args) -> Result<(), String> {
    let mut config = Config::new();
    config.share_memory_path_prefix = a.prefix.clone();
    config.queue_path = format!("{}_queue", a.prefix);
    config.mem_map_type = match a.mode.as_str() {
        "memfd" => MemMapType::MemMapTypeMemFd,
        "file" => MemMapType::MemMapTypeDevShmFile,
        m => return Err(format!("unknown mode {m}")),
    };
    let mut sessions = 1;
    match a.cell.as_str() {
        "closeorder" | "soak" | "traffic" => config.share_memory_buffer_cap = 1 << 20,
        "sessions" => sessions = 4,
        _ => {}
    }
    let smc = SessionManagerConfig::new()
        .with_config(config)
        .with_session_num(sessions);
    let (open, close): (Opener, cells::Closer) = if let Some(path) = a.addr.strip_prefix("unix:") {
        let sa = std::os::unix::net::SocketAddr::from_pathname(path).map_err(|e| e.to_string())?;
        let sm = SessionManager::new(smc, DefaultUnixConnect, sa)
            .await
            .map_err(|e| format!("session manager: {e}"))?;
        let sm2 = sm.clone();
        (
            Arc::new(move || sm.get_stream()),
            Box::new(move || Box::pin(async move { sm2.close().await })),
        )
    } else {
        let sa: std::net::SocketAddr =
            a.addr["tcp:".len()..].parse().map_err(|e| format!("{e}"))?;
        let sm = SessionManager::new(smc, DefaultTcpConnect, sa)
            .await
            .map_err(|e| format!("session manager: {e}"))?;
        let sm2 = sm.clone();
        (
            Arc::new(move || sm.get_stream()),
            Box::new(move || Box::pin(async move { sm2.close().await })),
        )
    };
    let result = cells::run(&a.cell, open, a.duration).await;
    // The crate's close waits up to 5 s per session for every slice to come
    // back before it unmaps the region (against the Go reference too); the
    // process exits after 1 s of it, which closes the connections anyway.
    let _ = tokio::time::timeout(Duration::from_secs(1), close()).await;
    result
}
