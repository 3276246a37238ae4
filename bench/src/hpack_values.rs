//! `hpack-values`: what HTTP/2's header compression costs for values that
//! change with every message, indexed (h2's default) against never
//! indexed (what the proxy sends: `strip_hop_by_hop_http2` marks them),
//! measured in one run.
//!
//! An h2 client and server run in one process over an in-memory pipe (no
//! sockets, no TLS: only the HTTP/2 work the choice changes). Each request
//! and response goes through the proxy's own pass over its headers: the
//! HTTP/2 one (which marks `Date` and request ids) for "never indexed", the
//! HTTP/1 one (the same pass over the names, marking nothing) for
//! "indexed".
//!
//! h2's encoder walks every value it holds under a name, oldest first,
//! before it adds one, and a `Date` a second fills its 4 KiB table within
//! a minute: what the choice costs depends on how old the connection is.
//! So each case first sends `age` responses with a distinct `Date` each
//! (a connection `age` seconds old), then the measured requests, with a
//! new `Date` every 1,000 (one second at 1k req/s). Every case runs twice:
//! without, then with an `x-request-id` of its own on every request.
//!
//! usage: hpack-values [--requests N] [--reps N] [--ages 1,10,30,100]
//!
//! Prints, per case, the median and range of the interleaved repetitions
//! (each way first in every other one) in ns per request and response,
//! and never indexed / indexed of the medians (below 1.0: never indexing
//! is cheaper).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use http::{header, HeaderMap, HeaderValue, Request, Response};
use tether_mesh_up::loadgen::request_id;
use tether_proxy::http::{strip_hop_by_hop, strip_hop_by_hop_http2};

/// How the values that change with every message go out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Values {
    Indexed,
    NeverIndexed,
}

impl Values {
    fn strip(self, headers: &mut HeaderMap) {
        match self {
            Values::Indexed => strip_hop_by_hop(headers),
            Values::NeverIndexed => {
                strip_hop_by_hop_http2(headers);
            }
        }
    }
}

/// One case: a connection `age` seconds old, requests with or without an
/// id of their own.
#[derive(Clone, Copy, Debug)]
struct Case {
    age: usize,
    request_id: bool,
}

/// Requests a second, for the `Date` of the measured requests.
const RATE: usize = 1_000;
/// Caps each run of a case (one repetition, one way); far past what a run
/// of the defaults takes (~0.1 s).
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// At most this many ages in one run of the bench.
const MAX_AGES: usize = 8;

fn date(second: usize) -> HeaderValue {
    let (h, m, s) = ((second / 3600) % 24, (second / 60) % 60, second % 60);
    HeaderValue::from_str(&format!("Tue, 01 Dec 2026 {h:02}:{m:02}:{s:02} GMT"))
        .expect("a date is a valid header value")
}

/// Runs `case` on a fresh connection: `age` warm-up requests, then
/// `requests` measured ones. Returns the measured time per request.
async fn run(case: Case, values: Values, requests: usize) -> anyhow::Result<Duration> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let server = tokio::spawn(async move {
        let mut conn = h2::server::handshake(server_io).await?;
        let mut served = 0;
        while let Some(stream) = conn.accept().await {
            let (_req, mut respond) = stream?;
            // One `Date` per warm-up response, then one per second.
            let second = if served < case.age {
                served
            } else {
                case.age + (served - case.age) / RATE
            };
            served += 1;
            let (mut parts, ()) = Response::new(()).into_parts();
            parts
                .headers
                .insert(header::SERVER, HeaderValue::from_static("nginx/1.22.1"));
            parts.headers.insert(header::DATE, date(second));
            parts.headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            values.strip(&mut parts.headers);
            respond.send_response(Response::from_parts(parts, ()), true)?;
        }
        Ok::<_, h2::Error>(())
    });
    let (mut client, conn) = h2::client::handshake(client_io).await?;
    let driver = tokio::spawn(conn);
    let mut started = Instant::now();
    for i in 0..case.age + requests {
        if i == case.age {
            started = Instant::now();
        }
        let (mut parts, ()) = Request::get("http://web.bench.svc.cluster.local:8080/")
            .header(header::USER_AGENT, "hpack-values/1")
            .body(())?
            .into_parts();
        if case.request_id {
            parts.headers.insert("x-request-id", request_id(i as u64));
        }
        values.strip(&mut parts.headers);
        client = client.ready().await?;
        let (rsp, _) = client.send_request(Request::from_parts(parts, ()), true)?;
        let rsp = rsp.await?;
        if !rsp.headers().contains_key(header::DATE) {
            bail!("a response lost its Date");
        }
    }
    let elapsed = started.elapsed();
    drop(client);
    server.await??;
    driver.abort();
    Ok(elapsed / requests as u32)
}

/// The median, lowest and highest of `xs` (not empty).
fn spread(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[0], xs[xs.len() - 1])
}

struct Args {
    requests: usize,
    reps: usize,
    ages: Vec<usize>,
}

fn parse(argv: impl Iterator<Item = String>) -> anyhow::Result<Args> {
    let mut args = Args {
        requests: 20_000,
        reps: 5,
        ages: vec![1, 10, 30, 100],
    };
    let mut argv = argv.peekable();
    while let Some(flag) = argv.next() {
        let value = argv
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        let number = |what: &str, max: usize| -> anyhow::Result<usize> {
            let n: usize = value
                .parse()
                .with_context(|| format!("{flag} {value:?}: not a count"))?;
            if n == 0 || n > max {
                bail!("{flag} {n}: {what} must be 1 to {max}");
            }
            Ok(n)
        };
        match flag.as_str() {
            "--requests" => args.requests = number("requests", 1_000_000)?,
            "--reps" => args.reps = number("repetitions", 50)?,
            "--ages" => {
                args.ages = value
                    .split(',')
                    .map(|a| {
                        a.trim()
                            .parse::<usize>()
                            .ok()
                            .filter(|a| *a <= 3_600)
                            .with_context(|| {
                                format!("--ages {value:?}: {a:?} is not 0 to 3600 seconds")
                            })
                    })
                    .collect::<anyhow::Result<_>>()?;
                if args.ages.len() > MAX_AGES {
                    bail!("--ages {value:?}: at most {MAX_AGES} ages");
                }
            }
            other => bail!(
                "unknown flag {other:?}; usage: hpack-values [--requests N] [--reps N] [--ages 1,10,30,100]"
            ),
        }
    }
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = parse(std::env::args().skip(1))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "HPACK of values that change with every message: h2 client and server in one process, \
         {} requests per case after a warm-up of `age` distinct Dates, {} interleaved repetitions; \
         load average {}",
        args.requests,
        args.reps,
        tether_bench::loadavg()
    );
    println!(
        "  age (s)  request id   indexed: median (range)   never indexed: median (range)   never / indexed"
    );
    for request_id in [false, true] {
        for &age in &args.ages {
            let case = Case { age, request_id };
            let mut indexed = Vec::new();
            let mut never = Vec::new();
            for rep in 0..args.reps {
                // Each way goes first in every other repetition.
                let mut order = [Values::Indexed, Values::NeverIndexed];
                if rep % 2 == 1 {
                    order.reverse();
                }
                for values in order {
                    let per = runtime
                        .block_on(async {
                            tokio::time::timeout(RUN_LIMIT, run(case, values, args.requests)).await
                        })
                        .with_context(|| format!("{case:?}, {values:?}: over {RUN_LIMIT:?}"))??;
                    match values {
                        Values::Indexed => indexed.push(per.as_nanos() as f64),
                        Values::NeverIndexed => never.push(per.as_nanos() as f64),
                    }
                }
            }
            let (indexed, i_low, i_high) = spread(indexed);
            let (never, n_low, n_high) = spread(never);
            println!(
                "  {age:>7}  {:<10}  {indexed:>6.0} ns ({i_low:.0}-{i_high:.0})   {never:>13.0} ns ({n_low:.0}-{n_high:.0})   {:>15.2}",
                if request_id { "yes" } else { "no" },
                never / indexed
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways carry every request and response, on a connection young
    /// and old, with and without ids.
    #[tokio::test]
    async fn both_ways_carry_every_message() {
        for values in [Values::Indexed, Values::NeverIndexed] {
            for case in [
                Case {
                    age: 0,
                    request_id: false,
                },
                Case {
                    age: 70,
                    request_id: true,
                },
            ] {
                let per = run(case, values, 50).await.unwrap();
                assert!(per > Duration::ZERO, "{case:?} {values:?}");
            }
        }
    }

    #[test]
    fn flags_are_checked() {
        let parsed = |s: &str| parse(s.split_whitespace().map(String::from));
        let args = parsed("--requests 10 --reps 3 --ages 0,5").unwrap();
        assert_eq!((args.requests, args.reps, args.ages), (10, 3, vec![0, 5]));
        for bad in [
            "--reps 0",
            "--requests x",
            "--ages 1,x",
            "--ages 4000",
            "--what 1",
            "--reps",
        ] {
            assert!(parsed(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dates_are_dates() {
        assert_eq!(date(3_661), "Tue, 01 Dec 2026 01:01:01 GMT");
    }
}
