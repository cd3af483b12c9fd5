//! The kbench job profile and fio's JSON output.
//!
//! ```
//! use lull_bench::fio::{parse_fio_json, JobKind};
//! assert_eq!(JobKind::RandreadIops.iodepth(), 64);
//! let text = "note: something\n{\"jobs\":[{\"jobname\":\"j\",\"error\":0,\
//!   \"read\":{\"iops\":10.0,\"bw_bytes\":40960,\"total_ios\":10,\
//!   \"lat_ns\":{\"mean\":1000.0,\"percentile\":{\"50.000000\":900,\"99.000000\":2000}}}}]}";
//! let m = parse_fio_json(text).unwrap();
//! assert_eq!(m.ios, 10);
//! assert_eq!(m.lat_p99_ns, Some(2000.0));
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Largest fio output we parse; a real report is a few KiB. Guards against
/// feeding a runaway log to the JSON parser.
pub const FIO_OUTPUT_BYTES_MAX: usize = 64 << 20;

/// One job of the kbench profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum JobKind {
    /// 4 KiB random read IOPS at QD64.
    RandreadIops,
    /// 4 KiB random write IOPS at QD64.
    RandwriteIops,
    /// 128 KiB sequential read bandwidth at QD64.
    SeqreadBw,
    /// 128 KiB sequential write bandwidth at QD64.
    SeqwriteBw,
    /// 4 KiB random read latency at QD1.
    RandreadLat,
    /// 4 KiB random write latency at QD1.
    RandwriteLat,
}

/// What a job is judged by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Primary {
    Iops,
    Bandwidth,
    Latency,
}

impl JobKind {
    pub const ALL: [JobKind; 6] = [
        JobKind::RandreadIops,
        JobKind::RandwriteIops,
        JobKind::SeqreadBw,
        JobKind::SeqwriteBw,
        JobKind::RandreadLat,
        JobKind::RandwriteLat,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::RandreadIops => "randread-iops",
            JobKind::RandwriteIops => "randwrite-iops",
            JobKind::SeqreadBw => "seqread-bw",
            JobKind::SeqwriteBw => "seqwrite-bw",
            JobKind::RandreadLat => "randread-lat",
            JobKind::RandwriteLat => "randwrite-lat",
        }
    }

    /// fio's `rw=`.
    pub fn rw(self) -> &'static str {
        match self {
            JobKind::RandreadIops | JobKind::RandreadLat => "randread",
            JobKind::RandwriteIops | JobKind::RandwriteLat => "randwrite",
            JobKind::SeqreadBw => "read",
            JobKind::SeqwriteBw => "write",
        }
    }

    pub fn block_size_bytes(self) -> u64 {
        match self {
            JobKind::SeqreadBw | JobKind::SeqwriteBw => 128 << 10,
            _ => 4 << 10,
        }
    }

    pub fn iodepth(self) -> u32 {
        match self {
            JobKind::RandreadLat | JobKind::RandwriteLat => 1,
            _ => 64,
        }
    }

    pub fn primary(self) -> Primary {
        match self {
            JobKind::RandreadIops | JobKind::RandwriteIops => Primary::Iops,
            JobKind::SeqreadBw | JobKind::SeqwriteBw => Primary::Bandwidth,
            JobKind::RandreadLat | JobKind::RandwriteLat => Primary::Latency,
        }
    }

    /// fio arguments for this job against `uri`, after `fio`.
    pub fn fio_args(
        self,
        uri: &str,
        size_bytes: u64,
        runtime_secs: u64,
        ramp_secs: f64,
    ) -> Vec<String> {
        let ramp_ms = (ramp_secs * 1000.0).round() as u64;
        vec![
            "--output-format=json".into(),
            format!("--name={}", self.as_str()),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            format!("--rw={}", self.rw()),
            format!("--bs={}", self.block_size_bytes()),
            format!("--iodepth={}", self.iodepth()),
            "--numjobs=1".into(),
            format!("--size={size_bytes}"),
            "--time_based=1".into(),
            format!("--runtime={runtime_secs}s"),
            format!("--ramp_time={ramp_ms}ms"),
            // Percentiles of the full latency (submit to completion), not
            // only completion latency.
            "--lat_percentiles=1".into(),
            "--percentile_list=50:99".into(),
        ]
    }
}

/// What one fio run measured, summed over read and write.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FioMetrics {
    pub iops: f64,
    pub bw_bytes_per_sec: f64,
    /// I/Os completed after the ramp.
    pub ios: u64,
    pub lat_mean_ns: f64,
    pub lat_p50_ns: Option<f64>,
    pub lat_p99_ns: Option<f64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FioParseError {
    #[error("fio printed no JSON object (output starts {0:?})")]
    NoJson(String),
    #[error("fio output is not valid JSON: {0}")]
    Json(String),
    #[error("fio output has no jobs")]
    NoJobs,
    #[error("fio job {job:?} reported error {code}")]
    JobError { job: String, code: i64 },
    #[error("fio job {0:?} completed no I/O")]
    NoIo(String),
    #[error("fio output is {0} bytes, over the limit")]
    TooLarge(usize),
}

#[derive(Deserialize)]
struct FioOutput {
    #[serde(default)]
    jobs: Vec<FioJob>,
}

#[derive(Deserialize)]
struct FioJob {
    #[serde(default)]
    jobname: String,
    #[serde(default)]
    error: i64,
    #[serde(default)]
    read: Option<FioDir>,
    #[serde(default)]
    write: Option<FioDir>,
}

#[derive(Deserialize, Default)]
struct FioDir {
    #[serde(default)]
    iops: f64,
    #[serde(default)]
    bw_bytes: f64,
    #[serde(default)]
    total_ios: u64,
    #[serde(default)]
    clat_ns: Option<FioLat>,
    #[serde(default)]
    lat_ns: Option<FioLat>,
}

#[derive(Deserialize, Default)]
struct FioLat {
    #[serde(default)]
    mean: f64,
    #[serde(default)]
    percentile: Option<BTreeMap<String, f64>>,
}

impl FioLat {
    fn percentile(&self, p: f64) -> Option<f64> {
        // Keys look like "99.000000"; compare numerically so a different
        // number of decimals still matches.
        self.percentile
            .as_ref()?
            .iter()
            .find(|(k, _)| k.parse::<f64>().is_ok_and(|v| (v - p).abs() < 1e-9))
            .map(|(_, v)| *v)
    }
}

/// Parses fio's `--output-format=json` output. Text before the first line
/// that starts with `{` (fio's "note: ..." lines, the nbd engine's "connected"
/// line) and after the JSON object is ignored.
pub fn parse_fio_json(text: &str) -> Result<FioMetrics, FioParseError> {
    if text.len() > FIO_OUTPUT_BYTES_MAX {
        return Err(FioParseError::TooLarge(text.len()));
    }
    let start =
        json_start(text).ok_or_else(|| FioParseError::NoJson(text.chars().take(80).collect()))?;
    let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<FioOutput>();
    let out = match stream.next() {
        Some(Ok(out)) => out,
        Some(Err(e)) => return Err(FioParseError::Json(e.to_string())),
        None => return Err(FioParseError::NoJson(String::new())),
    };
    let job = out.jobs.into_iter().next().ok_or(FioParseError::NoJobs)?;
    if job.error != 0 {
        return Err(FioParseError::JobError {
            job: job.jobname,
            code: job.error,
        });
    }
    let dirs: Vec<FioDir> = [job.read, job.write]
        .into_iter()
        .flatten()
        .filter(|d| d.total_ios > 0)
        .collect();
    let ios: u64 = dirs.iter().map(|d| d.total_ios).sum();
    if ios == 0 {
        return Err(FioParseError::NoIo(job.jobname));
    }
    let iops = dirs.iter().map(|d| d.iops).sum();
    let bw_bytes_per_sec = dirs.iter().map(|d| d.bw_bytes).sum();
    // Mean weighted by I/O count; percentiles from the direction that did
    // most of the I/O (the profile only has single-direction jobs).
    let lat = |d: &FioDir| -> FioLatView { FioLatView::of(d) };
    let lat_mean_ns = dirs
        .iter()
        .map(|d| lat(d).mean * d.total_ios as f64)
        .sum::<f64>()
        / ios as f64;
    let main = dirs
        .iter()
        .max_by_key(|d| d.total_ios)
        .map(lat)
        .unwrap_or_default();
    Ok(FioMetrics {
        iops,
        bw_bytes_per_sec,
        ios,
        lat_mean_ns,
        lat_p50_ns: main.p50,
        lat_p99_ns: main.p99,
    })
}

#[derive(Default)]
struct FioLatView {
    mean: f64,
    p50: Option<f64>,
    p99: Option<f64>,
}

impl FioLatView {
    /// Prefers total latency (`lat_ns`), falls back to completion latency
    /// (`clat_ns`) for fio runs without `lat_percentiles`.
    fn of(d: &FioDir) -> FioLatView {
        let pick = |p: f64| {
            d.lat_ns
                .as_ref()
                .and_then(|l| l.percentile(p))
                .or_else(|| d.clat_ns.as_ref().and_then(|l| l.percentile(p)))
        };
        let mean = d
            .lat_ns
            .as_ref()
            .map(|l| l.mean)
            .filter(|m| *m > 0.0)
            .or_else(|| d.clat_ns.as_ref().map(|l| l.mean))
            .unwrap_or(0.0);
        FioLatView {
            mean,
            p50: pick(50.0),
            p99: pick(99.0),
        }
    }
}

fn json_start(text: &str) -> Option<usize> {
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with('{') {
            return Some(offset + (line.len() - line.trim_start().len()));
        }
        offset += line.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const RANDREAD_QD64: &str = include_str!("../tests/data/fio_nbd_randread_qd64.json");
    const RANDWRITE_QD1: &str = include_str!("../tests/data/fio_nbd_randwrite_qd1.json");

    #[test]
    fn recorded_randread_qd64_clat_percentiles_only() {
        // fio 3.33 against nbdkit memory; no lat_percentiles, so p50/p99
        // come from clat_ns while the mean comes from lat_ns.
        let m = parse_fio_json(RANDREAD_QD64).unwrap();
        assert_eq!(m.ios, 82340);
        assert!((m.iops - 82257.742258).abs() < 1e-6);
        assert_eq!(m.bw_bytes_per_sec, 336927712.0);
        assert!((m.lat_mean_ns - 776700.188050).abs() < 1e-6);
        assert_eq!(m.lat_p50_ns, Some(741376.0));
        assert_eq!(m.lat_p99_ns, Some(1171456.0));
    }

    #[test]
    fn recorded_randwrite_qd1_lat_percentiles() {
        let m = parse_fio_json(RANDWRITE_QD1).unwrap();
        assert!(m.ios > 0);
        assert!(m.iops > 0.0);
        assert!(m.lat_mean_ns > 0.0);
        assert!(m.lat_p50_ns.is_some() && m.lat_p99_ns.is_some());
        assert!(m.lat_p50_ns <= m.lat_p99_ns);
    }

    #[test]
    fn odd_output_is_an_error_not_a_panic() {
        assert!(matches!(parse_fio_json(""), Err(FioParseError::NoJson(_))));
        assert!(matches!(
            parse_fio_json("fio: engine nbd not loadable\n"),
            Err(FioParseError::NoJson(_))
        ));
        assert!(matches!(
            parse_fio_json("{\"jobs\": [ {"),
            Err(FioParseError::Json(_))
        ));
        assert!(matches!(
            parse_fio_json("{\"jobs\": []}"),
            Err(FioParseError::NoJobs)
        ));
        assert!(matches!(parse_fio_json("{}"), Err(FioParseError::NoJobs)));
        assert!(matches!(
            parse_fio_json("{\"jobs\": [{\"jobname\":\"x\",\"error\":5}]}"),
            Err(FioParseError::JobError { code: 5, .. })
        ));
        assert!(matches!(
            parse_fio_json("{\"jobs\": [{\"jobname\":\"x\"}]}"),
            Err(FioParseError::NoIo(_))
        ));
        assert!(matches!(
            parse_fio_json("{\"jobs\": \"x\"}"),
            Err(FioParseError::Json(_))
        ));
        // A truncated recorded sample.
        assert!(parse_fio_json(&RANDREAD_QD64[..RANDREAD_QD64.len() / 2]).is_err());
    }

    #[test]
    fn trailing_text_and_mixed_directions() {
        let text = "note: x\n{\"jobs\":[{\"jobname\":\"j\",\"read\":{\"iops\":100,\"bw_bytes\":1,\"total_ios\":300,\"lat_ns\":{\"mean\":10}},\
                    \"write\":{\"iops\":50,\"bw_bytes\":2,\"total_ios\":100,\"clat_ns\":{\"mean\":30,\"percentile\":{\"50.0\":25,\"99.00\":40}}}}]}\nfio: done\n";
        let m = parse_fio_json(text).unwrap();
        assert_eq!(m.ios, 400);
        assert_eq!(m.iops, 150.0);
        assert_eq!(m.bw_bytes_per_sec, 3.0);
        assert_eq!(m.lat_mean_ns, 15.0);
        // Percentiles follow the bigger direction (read), which has none.
        assert_eq!(m.lat_p50_ns, None);
    }

    #[test]
    fn job_profile() {
        assert_eq!(JobKind::SeqwriteBw.block_size_bytes(), 131072);
        assert_eq!(JobKind::RandwriteLat.iodepth(), 1);
        let args = JobKind::SeqreadBw.fio_args("nbd://127.0.0.1:1/bench", 1 << 20, 3, 0.5);
        assert!(args.contains(&"--rw=read".to_string()));
        assert!(args.contains(&"--ramp_time=500ms".to_string()));
        assert!(args.contains(&"--uri=nbd://127.0.0.1:1/bench".to_string()));
    }
}
