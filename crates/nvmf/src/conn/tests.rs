//! A queue pair driven without a reactor: a scripted host writes PDUs
//! into an in-memory stream, the protocol half runs the pump's steps, and
//! the PDUs it wrote are decoded and checked. A memory volume completes
//! inside `submit`, so one run answers everything.

use std::io;

use lull_bdev::MallocDev;
use lull_net::server::{Connections, Limits};
use lull_net::wire::Protocol;
use lull_volume::{Storage, Volume, Volumes};
use proptest::prelude::*;

use super::*;

#[derive(Default)]
struct Pipe {
    input: Vec<u8>,
    pos: usize,
    out: Vec<u8>,
    /// `read` calls, including those that would block.
    reads: usize,
    /// Hand out at most this many bytes per read (0: no limit).
    read_max: usize,
}

impl Read for Pipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reads += 1;
        let buf = if self.read_max > 0 && buf.len() > self.read_max {
            &mut buf[..self.read_max]
        } else {
            buf
        };
        if self.pos == self.input.len() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.input.len() - self.pos);
        buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

const VOLUME_BYTES: u64 = 1 << 20;
const NQN: &str = "nqn.2026-11.io.lull:v";

fn shared() -> Arc<Shared> {
    shared_with(std::collections::HashMap::new())
}

/// A target with one 1 MiB memory volume `v`, served with `options`.
fn shared_with(options: std::collections::HashMap<String, crate::SubsystemOptions>) -> Arc<Shared> {
    shared_sized(VOLUME_BYTES, options)
}

fn shared_sized(
    bytes: u64,
    options: std::collections::HashMap<String, crate::SubsystemOptions>,
) -> Arc<Shared> {
    let volumes = Arc::new(Volumes::default());
    let dev = MallocDev::new(bytes).expect("malloc");
    volumes
        .add(Volume::new("v", Storage::Local(Arc::new(dev))))
        .expect("add");
    let conns = Arc::new(Connections::new(Limits {
        name: "nvmf-test",
        max_connections: 4,
        greeting_timeout_us: 1_000_000,
    }));
    Shared::new(volumes, conns, options, "127.0.0.1:4420".parse().unwrap())
}

/// Both digests on, as SPDK's perf may ask.
const DG: Digests = Digests {
    header: true,
    data: true,
};

/// A decoded PDU the target sent, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Got {
    IcResp(pdu::IcResp),
    Resp {
        cid: u16,
        status: u16,
        dw0: u32,
        dw1: u32,
        sqhd: u16,
    },
    Data {
        cid: u16,
        datao: u32,
        data: Vec<u8>,
        flags: u8,
    },
    R2t(pdu::R2t),
    Term {
        fes: u16,
        fei: u32,
    },
}

struct Host {
    conn: Conn<Pipe>,
    dg: Digests,
    /// Output bytes already decoded.
    seen: usize,
}

impl Host {
    fn new(shared: &Arc<Shared>) -> Host {
        Host {
            conn: Conn::new(Pipe::default(), -1, "test".into(), shared.clone()),
            dg: Digests::default(),
            seen: 0,
        }
    }

    fn run(&mut self) {
        // A new poller run, as when the reactor reports the socket.
        self.conn.socket_drained = false;
        for _ in 0..100 {
            let c = &mut self.conn;
            let mut p = c.advance();
            p |= bufs::with_pool(|pool| c.wire.flush(pool));
            if !c.wire.is_closing() {
                p |= Protocol::read_and_dispatch(c);
                p |= c.advance();
                p |= bufs::with_pool(|pool| c.wire.flush(pool));
            } else {
                p |= c.abandon_input();
            }
            if !p {
                break;
            }
        }
        self.conn.check_invariants();
    }

    fn send_raw(&mut self, bytes: &[u8]) -> Vec<Got> {
        self.conn
            .wire
            .stream
            .plain_mut()
            .input
            .extend_from_slice(bytes);
        self.run();
        self.take()
    }

    fn send(&mut self, p: &Pdu<'_>) -> Vec<Got> {
        let dg = if matches!(p, Pdu::IcReq(_)) {
            Digests::default()
        } else {
            self.dg
        };
        self.send_raw(&pdu::encode(p, dg))
    }

    /// Decode what the target wrote since the last call.
    fn take(&mut self) -> Vec<Got> {
        let mut got = Vec::new();
        loop {
            let out = &self.conn.wire.stream.plain().out[self.seen..];
            let dg = if got.is_empty() && self.dg == Digests::default() {
                Digests::default()
            } else {
                self.dg
            };
            // TermReqs carry no digests.
            let dg = if out.first() == Some(&pdu::TYPE_C2H_TERM_REQ) {
                Digests::default()
            } else {
                dg
            };
            let Some((p, used)) = pdu::decode(out, dg).expect("the target's PDUs decode") else {
                break;
            };
            got.push(match p {
                Pdu::IcResp(r) => Got::IcResp(r),
                Pdu::CapsuleResp { cqe } => Got::Resp {
                    dw0: u32::from_le_bytes(cqe[0..4].try_into().unwrap()),
                    dw1: u32::from_le_bytes(cqe[4..8].try_into().unwrap()),
                    sqhd: u16::from_le_bytes([cqe[8], cqe[9]]),
                    cid: u16::from_le_bytes([cqe[12], cqe[13]]),
                    status: u16::from_le_bytes([cqe[14], cqe[15]]),
                },
                Pdu::C2HData { hdr, data } => Got::Data {
                    cid: hdr.cccid,
                    datao: hdr.datao,
                    data: data.to_vec(),
                    flags: hdr.flags,
                },
                Pdu::R2t(r) => Got::R2t(r),
                Pdu::TermReq { fes, fei, .. } => Got::Term { fes, fei },
                other => panic!("the target sent {other:?}"),
            });
            self.seen += used;
        }
        got
    }

    fn ic(&mut self, dg: Digests) {
        let got = self.send(&Pdu::IcReq(pdu::IcReq {
            pfv: 0,
            hpda: 0,
            digests: dg,
            maxr2t: 0,
        }));
        assert!(
            matches!(&got[..], [Got::IcResp(r)] if r.digests == dg && r.maxh2cdata as usize == MAX_H2C_DATA_BYTES)
        );
        self.dg = dg;
    }

    fn cmd(&mut self, sqe: [u8; 64], data: &[u8]) -> Vec<Got> {
        self.send(&Pdu::CapsuleCmd { sqe, data })
    }

    fn connect(&mut self, qid: u16, cntlid: u16, subnqn: &str) -> Got {
        self.connect_as(qid, cntlid, subnqn, "nqn.host")
    }

    fn connect_as(&mut self, qid: u16, cntlid: u16, subnqn: &str, hostnqn: &str) -> Got {
        self.connect_cattr(qid, cntlid, subnqn, hostnqn, 0)
    }

    fn connect_cattr(
        &mut self,
        qid: u16,
        cntlid: u16,
        subnqn: &str,
        hostnqn: &str,
        cattr: u32,
    ) -> Got {
        let mut d = vec![0u8; 1024];
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        d[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
        d[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
        let mut s = sqe(
            spec::OPC_FABRICS,
            1,
            0,
            &[(10, u32::from(qid) << 16), (11, 31 | (cattr << 16))],
        );
        s[4] = spec::FCTYPE_CONNECT;
        set_sgl(&mut s, spec::SGL_IN_CAPSULE, 1024);
        let got = self.cmd(s, &d);
        assert_eq!(got.len(), 1, "{got:?}");
        got[0].clone()
    }
}

fn sqe(opc: u8, cid: u16, nsid: u32, dwords: &[(usize, u32)]) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opc;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4..8].copy_from_slice(&nsid.to_le_bytes());
    for &(i, v) in dwords {
        s[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    s
}

fn set_sgl(s: &mut [u8; 64], kind: u8, len: u32) {
    s[32..36].copy_from_slice(&len.to_le_bytes());
    s[39] = kind;
}

fn status_of(g: &Got) -> u16 {
    match g {
        Got::Resp { status, .. } => *status,
        other => panic!("expected a response, got {other:?}"),
    }
}

fn ok(g: &Got) {
    assert_eq!(status_of(g), 0, "{g:?}");
}

/// Admin queue connected and enabled; returns the controller id.
fn admin(h: &mut Host) -> u16 {
    h.ic(DG);
    let r = h.connect(0, 0xFFFF, NQN);
    ok(&r);
    let Got::Resp { dw0, .. } = r else {
        unreachable!()
    };
    let mut s = sqe(spec::OPC_FABRICS, 2, 0, &[(11, spec::PROP_CC), (12, 1)]);
    s[4] = spec::FCTYPE_PROPERTY_SET;
    ok(&h.cmd(s, &[])[0]);
    dw0 as u16
}

#[test]
fn admin_queue_answers_what_an_initiator_asks() {
    let shared = shared();
    let mut h = Host::new(&shared);
    let cntlid = admin(&mut h);
    assert_eq!(cntlid, 1);
    assert_eq!(shared.controller_count(), 1);

    // Properties.
    let mut s = sqe(spec::OPC_FABRICS, 3, 0, &[(10, 1), (11, spec::PROP_CAP)]);
    s[4] = spec::FCTYPE_PROPERTY_GET;
    let got = h.cmd(s, &[]);
    let Got::Resp { dw0, dw1, .. } = got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(
        u64::from(dw0) | (u64::from(dw1) << 32),
        spec::cap(MAX_QUEUE_ENTRIES)
    );
    let mut s = sqe(spec::OPC_FABRICS, 4, 0, &[(11, spec::PROP_CSTS)]);
    s[4] = spec::FCTYPE_PROPERTY_GET;
    assert!(matches!(
        h.cmd(s, &[])[0],
        Got::Resp {
            dw0: 1,
            status: 0,
            ..
        }
    ));

    // Identify controller and namespace.
    let mut s = sqe(spec::ADMIN_IDENTIFY, 5, 0, &[(10, 1)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    let Got::Data { data, cid: 5, .. } = &got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(u16::from_le_bytes([data[78], data[79]]), cntlid);
    assert_eq!(&data[768..768 + NQN.len()], NQN.as_bytes());
    ok(&got[1]);
    let mut s = sqe(spec::ADMIN_IDENTIFY, 6, 1, &[(10, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    let Got::Data { data, .. } = &got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(
        u64::from_le_bytes(data[0..8].try_into().unwrap()),
        VOLUME_BYTES / 512
    );
    // Namespace 2 does not exist.
    let mut s = sqe(spec::ADMIN_IDENTIFY, 7, 2, &[(10, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::INVALID_NAMESPACE.field()
    );

    // Logs: SMART is 512 zero bytes; an unknown page is an invalid field.
    let numdl = (512u32 / 4 - 1) << 16;
    let mut s = sqe(spec::ADMIN_GET_LOG_PAGE, 8, 0xFFFF_FFFF, &[(10, numdl | 2)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    let got = h.cmd(s, &[]);
    assert!(
        matches!(&got[0], Got::Data { data, .. } if data.len() == 512 && data.iter().all(|&b| b == 0))
    );
    ok(&got[1]);
    let mut s = sqe(spec::ADMIN_GET_LOG_PAGE, 9, 0, &[(10, numdl | 0xC0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(status_of(&h.cmd(s, &[])[0]), Status::INVALID_FIELD.field());

    // Features.
    let s = sqe(
        spec::ADMIN_SET_FEATURES,
        10,
        0,
        &[(10, 7), (11, (3 << 16) | 3)],
    );
    assert!(matches!(
        h.cmd(s, &[])[0],
        Got::Resp {
            dw0: 0x0003_0003,
            status: 0,
            ..
        }
    ));
    let s = sqe(spec::ADMIN_SET_FEATURES, 11, 0, &[(10, 0x0F), (11, 10_000)]);
    ok(&h.cmd(s, &[])[0]);
    let s = sqe(spec::ADMIN_GET_FEATURES, 12, 0, &[(10, 0x0F)]);
    assert!(matches!(h.cmd(s, &[])[0], Got::Resp { dw0: 10_000, .. }));
    let s = sqe(spec::ADMIN_KEEP_ALIVE, 13, 0, &[]);
    ok(&h.cmd(s, &[])[0]);
    // An opcode the target does not know.
    let s = sqe(0xEE, 14, 0, &[]);
    assert_eq!(status_of(&h.cmd(s, &[])[0]), Status::INVALID_OPCODE.field());
    // An AER is held, not answered.
    let s = sqe(spec::ADMIN_ASYNC_EVENT_REQUEST, 15, 0, &[]);
    assert!(h.cmd(s, &[]).is_empty());

    // The controller goes with its admin queue.
    drop(h);
    assert_eq!(shared.controller_count(), 0);
}

#[test]
fn io_queue_reads_and_writes_the_volume() {
    let shared = shared();
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut h = Host::new(&shared);
    h.ic(DG);
    ok(&h.connect(1, cntlid, NQN));
    // A wrong controller id or subsystem is refused.
    let mut bad = Host::new(&shared);
    bad.ic(Digests::default());
    assert_eq!(
        status_of(&bad.connect(1, 77, NQN)),
        Status::CONNECT_INVALID_PARAMETERS.field()
    );
    let mut bad = Host::new(&shared);
    bad.ic(Digests::default());
    let refused = bad.connect(0, 0xFFFF, "nqn.2026-11.io.lull:nope");
    assert_eq!(
        status_of(&refused),
        Status::CONNECT_INVALID_PARAMETERS.field()
    );
    // IATTR (bit 16): in the Connect data; IPO (bits 15:0): SUBNQN's
    // offset in it, 256 (what Linux logs as "subsysnqn").
    let Got::Resp { dw0, .. } = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(dw0, (1 << 16) | 256, "{dw0:#x}");

    // 4 KiB in the capsule at LBA 8.
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut s = sqe(spec::NVM_WRITE, 20, 1, &[(10, 8), (12, 7)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 4096);
    ok(&h.cmd(s, &pattern)[0]);

    // 64 KiB through R2T at LBA 64, sent as two H2CData PDUs.
    let big: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
    let mut s = sqe(spec::NVM_WRITE, 21, 1, &[(10, 64), (12, 127)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 65536);
    let got = h.cmd(s, &[]);
    let [Got::R2t(r2t)] = got[..] else {
        panic!("{got:?}")
    };
    assert_eq!((r2t.cccid, r2t.r2to, r2t.r2tl), (21, 0, 65536));
    for (i, half) in big.chunks(32768).enumerate() {
        let got = h.send(&Pdu::H2CData {
            hdr: DataHeader {
                cccid: 21,
                ttag: r2t.ttag,
                datao: (i * 32768) as u32,
                flags: if i == 1 { pdu::FLAG_LAST_PDU } else { 0 },
            },
            data: half,
        });
        if i == 1 {
            ok(&got[0]);
        } else {
            assert!(got.is_empty(), "{got:?}");
        }
    }

    // Read both back.
    let mut s = sqe(spec::NVM_READ, 22, 1, &[(10, 8), (12, 7)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    assert!(
        matches!(&got[0], Got::Data { cid: 22, datao: 0, data, flags } if *data == pattern && flags & pdu::FLAG_LAST_PDU != 0)
    );
    ok(&got[1]);
    let mut s = sqe(spec::NVM_READ, 23, 1, &[(10, 64), (12, 127)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 65536);
    let got = h.cmd(s, &[]);
    assert!(matches!(&got[0], Got::Data { data, .. } if *data == big));

    // Errors: past the end, too long, wrong namespace, SGL length.
    let blocks = (VOLUME_BYTES / 512) as u32;
    let mut s = sqe(spec::NVM_READ, 24, 1, &[(10, blocks - 1), (12, 1)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 1024);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
    let mut s = sqe(spec::NVM_WRITE, 25, 1, &[(10, 0), (12, 511)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512 * 512);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::DATA_SGL_LENGTH_INVALID.field()
    );
    let mut s = sqe(spec::NVM_READ, 26, 2, &[(12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::INVALID_NAMESPACE.field()
    );
    let mut s = sqe(spec::NVM_READ, 27, 1, &[(12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::DATA_SGL_LENGTH_INVALID.field()
    );
    let s = sqe(0x99, 28, 1, &[]);
    assert_eq!(status_of(&h.cmd(s, &[])[0]), Status::INVALID_OPCODE.field());

    // Flush, then Write Zeroes over the first write reads back zeros.
    ok(&h.cmd(sqe(spec::NVM_FLUSH, 29, 1, &[]), &[])[0]);
    ok(&h.cmd(sqe(spec::NVM_WRITE_ZEROES, 30, 1, &[(10, 8), (12, 7)]), &[])[0]);
    let mut s = sqe(spec::NVM_READ, 31, 1, &[(10, 8), (12, 7)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    assert!(matches!(&got[0], Got::Data { data, .. } if data.iter().all(|&b| b == 0)));

    // Disconnect: answered, then closed.
    let mut s = sqe(spec::OPC_FABRICS, 32, 0, &[]);
    s[4] = spec::FCTYPE_DISCONNECT;
    ok(&h.cmd(s, &[])[0]);
    assert!(h.conn.wire.is_closing());
}

/// An I/O queue on controller `cntlid`.
fn io_queue(shared: &Arc<Shared>, cntlid: u16, subnqn: &str) -> Host {
    let mut h = Host::new(shared);
    h.ic(DG);
    ok(&h.connect(1, cntlid, subnqn));
    h
}

/// Write `data` at `slba` (512-byte LBAs) and read it back through `h`.
fn write_at(h: &mut Host, cid: u16, slba: u32, data: &[u8]) {
    let nlb = (data.len() / 512) as u32;
    let mut s = sqe(spec::NVM_WRITE, cid, 1, &[(10, slba), (12, nlb - 1)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, data.len() as u32);
    ok(&h.cmd(s, data)[0]);
}

fn read_at(h: &mut Host, cid: u16, slba: u32, bytes: usize, lba_bytes: usize) -> Vec<u8> {
    let nlb = (bytes / lba_bytes) as u32;
    let mut s = sqe(spec::NVM_READ, cid, 1, &[(10, slba), (12, nlb - 1)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, bytes as u32);
    let got = h.cmd(s, &[]);
    ok(&got[1]);
    match &got[0] {
        Got::Data { data, .. } => data.clone(),
        other => panic!("expected data, got {other:?}"),
    }
}

/// Dataset Management ranges: (SLBA, NLB).
fn dsm_ranges(ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut d = Vec::new();
    for &(slba, nlb) in ranges {
        d.extend_from_slice(&0u32.to_le_bytes());
        d.extend_from_slice(&nlb.to_le_bytes());
        d.extend_from_slice(&slba.to_le_bytes());
    }
    d
}

#[test]
fn dataset_management_deallocates_ranges_and_checks_them() {
    let shared = shared();
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut h = io_queue(&shared, cntlid, NQN);
    let ones = vec![0xA5u8; 8192];
    write_at(&mut h, 1, 0, &ones);
    write_at(&mut h, 2, 100, &ones);

    // Two ranges (NR = 1), deallocate: LBAs 2..6 and 104..106.
    let dsm = |cid, nr: u32, ad: bool, data: &[u8], len: u32| {
        let attr = if ad { spec::DSM_ATTR_DEALLOCATE } else { 0 };
        let mut s = sqe(
            spec::NVM_DATASET_MANAGEMENT,
            cid,
            1,
            &[(10, nr), (11, attr)],
        );
        set_sgl(&mut s, spec::SGL_IN_CAPSULE, len);
        (s, data.to_vec())
    };
    let ranges = dsm_ranges(&[(2, 4), (104, 2)]);
    // Without the Deallocate attribute it is a hint: nothing changes.
    let (s, d) = dsm(3, 1, false, &ranges, 32);
    ok(&h.cmd(s, &d)[0]);
    assert_eq!(read_at(&mut h, 4, 0, 8192, 512), ones);
    let (s, d) = dsm(5, 1, true, &ranges, 32);
    ok(&h.cmd(s, &d)[0]);
    let first = read_at(&mut h, 6, 0, 8192, 512);
    assert!(first[..1024].iter().all(|&b| b == 0xA5));
    assert!(first[1024..3072].iter().all(|&b| b == 0));
    assert!(first[3072..].iter().all(|&b| b == 0xA5));
    let second = read_at(&mut h, 7, 100, 8192, 512);
    assert!(second[..2048].iter().all(|&b| b == 0xA5));
    assert!(second[2048..3072].iter().all(|&b| b == 0));

    // Through R2T too (SPDK sends the ranges that way).
    let mut s = sqe(
        spec::NVM_DATASET_MANAGEMENT,
        8,
        1,
        &[(10, 0), (11, spec::DSM_ATTR_DEALLOCATE)],
    );
    set_sgl(&mut s, spec::SGL_TRANSPORT, 16);
    let got = h.cmd(s, &[]);
    let [Got::R2t(r2t)] = got[..] else {
        panic!("{got:?}")
    };
    let got = h.send(&Pdu::H2CData {
        hdr: DataHeader {
            cccid: 8,
            ttag: r2t.ttag,
            datao: 0,
            flags: pdu::FLAG_LAST_PDU,
        },
        data: &dsm_ranges(&[(0, 1)]),
    });
    ok(&got[0]);
    assert!(read_at(&mut h, 9, 0, 512, 512).iter().all(|&b| b == 0));

    // A range past the end fails the command and discards nothing (the
    // first range is checked with the second).
    let blocks = VOLUME_BYTES / 512;
    let bad = dsm_ranges(&[(6, 2), (blocks - 1, 2)]);
    let (s, d) = dsm(10, 1, true, &bad, 32);
    assert_eq!(
        status_of(&h.cmd(s, &d)[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
    assert!(read_at(&mut h, 11, 6, 1024, 512).iter().all(|&b| b == 0xA5));
    let bad = dsm_ranges(&[(u64::MAX, 1)]);
    let (s, d) = dsm(12, 0, true, &bad, 16);
    assert_eq!(
        status_of(&h.cmd(s, &d)[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
    // Fewer range bytes than NR says, or more than 256 ranges' worth.
    let (s, d) = dsm(13, 3, true, &ranges, 32);
    assert_eq!(
        status_of(&h.cmd(s, &d)[0]),
        Status::DATA_SGL_LENGTH_INVALID.field()
    );
    let mut s = sqe(spec::NVM_DATASET_MANAGEMENT, 14, 1, &[(10, 255), (11, 4)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4112);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::DATA_SGL_LENGTH_INVALID.field()
    );
    // Wrong namespace.
    let mut s = sqe(spec::NVM_DATASET_MANAGEMENT, 15, 2, &[(11, 4)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 16);
    assert_eq!(
        status_of(&h.cmd(s, &dsm_ranges(&[(0, 1)]))[0]),
        Status::INVALID_NAMESPACE.field()
    );
    // ONCS says so.
    let mut s = sqe(spec::ADMIN_IDENTIFY, 16, 0, &[(10, 1)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = a.cmd(s, &[]);
    let Got::Data { data, .. } = &got[0] else {
        panic!("{got:?}")
    };
    assert_ne!(u16::from_le_bytes([data[520], data[521]]) & (1 << 2), 0);
}

/// An admin command that returns data: (the data, the response).
fn admin_data(h: &mut Host, s: [u8; 64]) -> Vec<u8> {
    let got = h.cmd(s, &[]);
    ok(got.last().expect("a response"));
    match &got[0] {
        Got::Data { data, .. } => data.clone(),
        other => panic!("expected data, got {other:?}"),
    }
}

fn identify(h: &mut Host, cid: u16, cns: u32, nsid: u32) -> Vec<u8> {
    let mut s = sqe(spec::ADMIN_IDENTIFY, cid, nsid, &[(10, cns)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    admin_data(h, s)
}

/// Get Log Page 04h (the Changed Namespace List) as NSIDs.
fn changed_ns(h: &mut Host, cid: u16, retain: bool) -> Vec<u32> {
    let numdl = (4096u32 / 4 - 1) << 16;
    let rae = if retain { 1 << 15 } else { 0 };
    let dw10 = numdl | rae | u32::from(spec::LOG_CHANGED_NS_LIST);
    let mut s = sqe(spec::ADMIN_GET_LOG_PAGE, cid, 0xFFFF_FFFF, &[(10, dw10)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    admin_data(h, s)
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .filter(|&n| n != 0)
        .collect()
}

fn set_aec(h: &mut Host, cid: u16, aec: u32) {
    let s = sqe(
        spec::ADMIN_SET_FEATURES,
        cid,
        0,
        &[(10, u32::from(spec::FEAT_ASYNC_EVENT_CONFIG)), (11, aec)],
    );
    ok(&h.cmd(s, &[])[0]);
}

#[test]
fn a_deallocate_range_larger_than_a_device_request_is_split() {
    // A sparse 3 GiB memory volume: a range of 2.5 GiB takes three device
    // trims (1 GiB at most each).
    let shared = shared_sized(3 << 30, std::collections::HashMap::new());
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut h = io_queue(&shared, cntlid, NQN);
    let lba = |bytes: u64| (bytes / 512) as u32;
    let marks = [1u64 << 20, (2 << 30) + (5 << 20), (5 << 29) - 512, 5 << 29];
    for (i, &at) in marks.iter().enumerate() {
        write_at(&mut h, i as u16, lba(at), &[0x5Au8; 512]);
    }
    let mut s = sqe(
        spec::NVM_DATASET_MANAGEMENT,
        10,
        1,
        &[(11, spec::DSM_ATTR_DEALLOCATE)],
    );
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 16);
    let range = dsm_ranges(&[(0, lba(5 << 29))]);
    ok(&h.cmd(s, &range)[0]);
    // Everything inside the 2.5 GiB is zeros, the block after it is not.
    for (i, &at) in marks.iter().enumerate() {
        let back = read_at(&mut h, 20 + i as u16, lba(at), 512, 512);
        let inside = at < 5 << 29;
        assert_eq!(back.iter().all(|&b| b == 0), inside, "at {at}");
    }
}

#[test]
fn a_deleted_volume_completes_the_async_event_request() {
    let shared = shared();
    // Host a asks for namespace attribute notices; host b does not.
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut io = io_queue(&shared, cntlid, NQN);
    set_aec(&mut a, 40, crate::target::AEC_NS_ATTRIBUTE);
    let mut b = Host::new(&shared);
    admin(&mut b);
    for (h, cid) in [(&mut a, 41), (&mut b, 41)] {
        assert!(
            h.cmd(sqe(spec::ADMIN_ASYNC_EVENT_REQUEST, cid, 0, &[]), &[])
                .is_empty(),
            "held"
        );
        // Nothing changed yet: the list is empty and the AER stays held.
        assert!(changed_ns(h, 42, false).is_empty());
    }
    write_at(&mut io, 1, 0, &[7u8; 512]);

    shared.volumes.remove("v").expect("delete the volume");
    // The admin queue runs (its poller is woken by the event): the held
    // AER completes with a notice naming log page 04h.
    let got = a.send_raw(&[]);
    assert_eq!(
        got,
        [Got::Resp {
            cid: 41,
            status: 0,
            dw0: crate::target::AEN_NS_ATTRIBUTE_CHANGED,
            dw1: 0,
            sqhd: a.conn.sqhd,
        }]
    );
    assert_eq!(crate::target::AEN_NS_ATTRIBUTE_CHANGED, 0x0004_0002);
    // Host b did not enable the notice: no completion, but the list has it.
    assert!(b.send_raw(&[]).is_empty());
    assert_eq!(changed_ns(&mut b, 43, false), [1]);
    assert!(changed_ns(&mut b, 44, false).is_empty(), "reading clears");

    // RAE keeps the list; a plain read returns and clears it.
    assert_eq!(changed_ns(&mut a, 43, true), [1]);
    assert_eq!(changed_ns(&mut a, 44, false), [1]);
    assert!(changed_ns(&mut a, 45, false).is_empty());

    // The namespace is inactive: Identify reads zeros, the active list is
    // empty, I/O fails with Invalid Namespace, and nothing crashes.
    assert!(identify(&mut a, 46, 0, 1).iter().all(|&x| x == 0));
    assert!(identify(&mut a, 47, 2, 0).iter().all(|&x| x == 0));
    let mut s = sqe(spec::NVM_READ, 2, 1, &[(12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(
        status_of(&io.cmd(s, &[])[0]),
        Status::INVALID_NAMESPACE.field()
    );
    let mut s = sqe(spec::NVM_WRITE, 3, 1, &[(12, 0)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 512);
    assert_eq!(
        status_of(&io.cmd(s, &[0u8; 512])[0]),
        Status::INVALID_NAMESPACE.field()
    );
    ok(&io.cmd(sqe(spec::NVM_FLUSH, 4, 1, &[]), &[])[0]);
    ok(&a.cmd(sqe(spec::ADMIN_KEEP_ALIVE, 48, 0, &[]), &[])[0]);
    assert!(!a.conn.wire.is_closing() && !io.conn.wire.is_closing());
    // A new host cannot connect to the deleted volume's subsystem.
    let mut c = Host::new(&shared);
    c.ic(Digests::default());
    assert_eq!(
        status_of(&c.connect(0, 0xFFFF, NQN)),
        Status::CONNECT_INVALID_PARAMETERS.field()
    );
}

#[test]
fn a_grown_volume_completes_the_async_event_request_and_takes_io_past_the_old_end() {
    let shared = shared();
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    // An I/O queue connected before the grow.
    let mut io = io_queue(&shared, cntlid, NQN);
    set_aec(&mut a, 40, crate::target::AEC_NS_ATTRIBUTE);
    assert!(a
        .cmd(sqe(spec::ADMIN_ASYNC_EVENT_REQUEST, 41, 0, &[]), &[])
        .is_empty());
    let old_blocks = VOLUME_BYTES / 512;
    let nsze = |h: &mut Host, cid| {
        let id = identify(h, cid, 0, 1);
        [0, 8, 16].map(|at| u64::from_le_bytes(id[at..at + 8].try_into().unwrap()))
    };
    assert_eq!(nsze(&mut a, 42), [old_blocks; 3]);
    // Past the old end: out of range.
    let mut s = sqe(spec::NVM_WRITE, 1, 1, &[(10, old_blocks as u32), (12, 0)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 512);
    assert_eq!(
        status_of(&io.cmd(s, &[1u8; 512])[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );

    let new_bytes = 4 * VOLUME_BYTES;
    shared.volumes.resize("v", new_bytes).expect("grow");
    let got = a.send_raw(&[]);
    assert_eq!(
        got,
        [Got::Resp {
            cid: 41,
            status: 0,
            dw0: crate::target::AEN_NS_ATTRIBUTE_CHANGED,
            dw1: 0,
            sqhd: a.conn.sqhd,
        }]
    );
    assert_eq!(changed_ns(&mut a, 43, false), [1]);
    let new_blocks = new_bytes / 512;
    // NSZE, NCAP, NUSE all report the new size; the namespace stays active.
    assert_eq!(nsze(&mut a, 44), [new_blocks; 3]);
    assert_eq!(identify(&mut a, 45, 2, 0)[0], 1);
    // The queue from before the grow writes and reads the new range, up
    // to its last LBA, and not one past it.
    write_at(&mut io, 2, old_blocks as u32, &[0xA5u8; 1024]);
    write_at(&mut io, 3, (new_blocks - 1) as u32, &[0x5Au8; 512]);
    assert_eq!(
        read_at(&mut io, 4, old_blocks as u32, 1024, 512),
        vec![0xA5u8; 1024]
    );
    assert_eq!(
        read_at(&mut io, 5, (new_blocks - 1) as u32, 512, 512),
        vec![0x5Au8; 512]
    );
    let mut s = sqe(spec::NVM_READ, 6, 1, &[(10, new_blocks as u32), (12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(
        status_of(&io.cmd(s, &[])[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
    // A refused resize raises nothing: a new AER stays held.
    assert!(a
        .cmd(sqe(spec::ADMIN_ASYNC_EVENT_REQUEST, 46, 0, &[]), &[])
        .is_empty());
    assert!(shared.volumes.resize("v", VOLUME_BYTES).is_err());
    assert!(a.send_raw(&[]).is_empty());
    assert!(changed_ns(&mut a, 47, false).is_empty());
}

#[test]
fn options_set_at_run_time_serve_a_new_volume_and_are_forgotten_with_it() {
    let shared = shared();
    let custom = "nqn.2026-11.test:w";
    let opts = || crate::SubsystemOptions {
        nqn: Some(custom.into()),
        lba_shift: crate::LBA_SHIFT_4K,
        allowed_hosts: vec!["nqn.good".into()],
    };
    // Refused: options for an existing volume, another volume's NQN, the
    // discovery NQN, an LBA size the target does not serve.
    assert!(shared.set_options("v", opts()).is_err());
    for bad in [NQN, spec::DISCOVERY_NQN] {
        let o = crate::SubsystemOptions {
            nqn: Some(bad.into()),
            ..opts()
        };
        assert!(shared.set_options("w", o).is_err(), "{bad}");
    }
    let o = crate::SubsystemOptions {
        lba_shift: 10,
        ..opts()
    };
    assert!(shared.set_options("w", o).is_err());
    shared.set_options("w", opts()).expect("options for w");
    assert!(shared.set_options("w", opts()).is_err(), "once");
    let dev = MallocDev::new(VOLUME_BYTES).expect("malloc");
    shared
        .volumes
        .add(Volume::new("w", Storage::Local(Arc::new(dev))))
        .expect("add w");
    assert_eq!(shared.nqn_of("w"), custom);
    assert_eq!(shared.lba_shift_of("w"), crate::LBA_SHIFT_4K);
    assert!(!shared.host_allowed("w", "nqn.bad"));
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    let refused = status_of(&h.connect_as(0, 0xFFFF, custom, "nqn.bad"));
    assert_ne!(refused, 0, "a host not on the list is refused");
    // Deleting the volume forgets its options.
    shared.volumes.remove("w").expect("delete w");
    assert_eq!(shared.nqn_of("w"), crate::subsystem_nqn("w"));
    assert_eq!(shared.lba_shift_of("w"), crate::LBA_SHIFT);
    assert!(shared.host_allowed("w", "nqn.bad"));
    shared
        .set_options("w", opts())
        .expect("again after the delete");
    shared.forget_options("w");
    assert_eq!(shared.nqn_of("w"), crate::subsystem_nqn("w"));
}

#[test]
fn the_allowlist_refuses_other_hosts_and_the_nqn_is_configurable() {
    let custom = "nqn.2026-11.test:custom";
    let shared = shared_with(
        [(
            "v".to_string(),
            crate::SubsystemOptions {
                nqn: Some(custom.into()),
                allowed_hosts: vec!["nqn.good".into()],
                ..Default::default()
            },
        )]
        .into(),
    );
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    // The default NQN names nothing now.
    assert_eq!(
        status_of(&h.connect_as(0, 0xFFFF, NQN, "nqn.good")),
        Status::CONNECT_INVALID_PARAMETERS.field()
    );
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    let refused = h.connect_as(0, 0xFFFF, custom, "nqn.bad");
    // Connect Invalid Host: SCT 1h, SC 84h, do not retry.
    assert_eq!(status_of(&refused), (1 << 15) | (1 << 9) | (0x84 << 1));
    assert_eq!(shared.controller_count(), 0);
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    ok(&h.connect_as(0, 0xFFFF, custom, "nqn.good"));
    assert_eq!(shared.controller_count(), 1);

    // The discovery log lists the subsystem only to hosts that may use it.
    for (host, entries) in [("nqn.good", 1u64), ("nqn.bad", 0)] {
        let mut d = Host::new(&shared);
        d.ic(Digests::default());
        ok(&d.connect_as(0, 0xFFFF, spec::DISCOVERY_NQN, host));
        let numdl = (2048u32 / 4 - 1) << 16;
        let mut s = sqe(
            spec::ADMIN_GET_LOG_PAGE,
            2,
            0,
            &[(10, numdl | u32::from(spec::LOG_DISCOVERY))],
        );
        set_sgl(&mut s, spec::SGL_TRANSPORT, 2048);
        let page = admin_data(&mut d, s);
        assert_eq!(
            u64::from_le_bytes(page[8..16].try_into().unwrap()),
            entries,
            "{host}"
        );
        if entries == 1 {
            assert_eq!(
                &page[1024 + 256..1024 + 256 + custom.len()],
                custom.as_bytes()
            );
        }
    }
}

/// A volume with a TLS key refuses plaintext Connects (Connect Invalid
/// Host), admin and I/O queues alike; the discovery log lists it only to
/// hosts with a key, marked secure channel required over TLS 1.3; the
/// last key removed, plaintext works again. A bad first byte that is
/// not TLS still gets the transport's error.
#[test]
fn a_volume_with_a_psk_requires_a_secure_channel() {
    let shared = shared();
    let key = crate::psk::parse_interchange(
        "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:",
    )
    .unwrap();
    shared.set_host_key("v", "nqn.keyed", &key).unwrap();
    // 48-byte keys need the SHA-384 suite, which is not offered.
    let k48 = crate::psk::parse_interchange(&crate::psk::format_interchange(
        &[3u8; 48],
        crate::psk::RetainedHash::Sha384,
    ))
    .unwrap();
    assert!(shared.set_host_key("v", "nqn.other", &k48).is_err());
    assert!(shared.secure_channel_required("v"));
    for host in ["nqn.keyed", "nqn.host"] {
        let mut h = Host::new(&shared);
        h.ic(Digests::default());
        assert_eq!(
            status_of(&h.connect_as(0, 0xFFFF, NQN, host)),
            Status::CONNECT_INVALID_HOST.field(),
            "{host}"
        );
    }
    assert_eq!(shared.controller_count(), 0);
    for (host, entries) in [("nqn.keyed", 1u64), ("nqn.host", 0)] {
        let mut d = Host::new(&shared);
        d.ic(Digests::default());
        ok(&d.connect_as(0, 0xFFFF, spec::DISCOVERY_NQN, host));
        let numdl = (2048u32 / 4 - 1) << 16;
        let mut s = sqe(
            spec::ADMIN_GET_LOG_PAGE,
            2,
            0,
            &[(10, numdl | u32::from(spec::LOG_DISCOVERY))],
        );
        set_sgl(&mut s, spec::SGL_TRANSPORT, 2048);
        let page = admin_data(&mut d, s);
        assert_eq!(
            u64::from_le_bytes(page[8..16].try_into().unwrap()),
            entries,
            "{host}"
        );
        if entries == 1 {
            assert_eq!((page[1024 + 3], page[1024 + 768]), (0b01, 2));
        }
    }
    assert!(shared.remove_host_key("v", "nqn.keyed"));
    assert!(!shared.secure_channel_required("v"));
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    ok(&h.connect_as(0, 0xFFFF, NQN, "nqn.host"));
}

/// The TLS key callback answers only an NVMe identity of a host with a
/// key, for its subsystem or discovery, with SPDK's derived key.
#[test]
fn the_tls_key_is_derived_for_known_identities_only() {
    let shared = shared();
    let key = crate::psk::parse_interchange(
        "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:",
    )
    .unwrap();
    shared.set_host_key("v", "nqn.keyed", &key).unwrap();
    let retained = key.retained("nqn.keyed").unwrap();
    for sub in [NQN, spec::DISCOVERY_NQN] {
        let id = crate::psk::identity("nqn.keyed", sub, key.cipher());
        assert_eq!(
            shared.tls_key(id.as_bytes()),
            Some(crate::psk::tls_psk(&retained, &id, key.cipher()).unwrap()),
            "{sub}"
        );
    }
    let cipher = key.cipher();
    for id in [
        crate::psk::identity("nqn.other", NQN, cipher),
        crate::psk::identity("nqn.keyed", "nqn.nothing", cipher),
        crate::psk::identity("nqn.keyed", NQN, crate::psk::Cipher::Aes256GcmSha384),
        "keyed".to_string(),
    ] {
        assert_eq!(shared.tls_key(id.as_bytes()), None, "{id}");
    }
}

#[test]
fn a_4k_lba_namespace_reports_and_uses_4k_blocks() {
    let shared = shared_with(
        [(
            "v".to_string(),
            crate::SubsystemOptions {
                lba_shift: crate::LBA_SHIFT_4K,
                ..Default::default()
            },
        )]
        .into(),
    );
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let ns = identify(&mut a, 10, 0, 1);
    let blocks = VOLUME_BYTES / 4096;
    assert_eq!(u64::from_le_bytes(ns[0..8].try_into().unwrap()), blocks);
    assert_eq!(ns[26] & 0xF, 0, "FLBAS: format 0");
    assert_eq!(ns[128 + 2], 12, "LBAF0: LBADS 12 (4 KiB)");
    let mut io = io_queue(&shared, cntlid, NQN);

    // One block (NLB 0) is 4 KiB.
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 241) as u8).collect();
    let mut s = sqe(spec::NVM_WRITE, 1, 1, &[(10, 3), (12, 0)]);
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 4096);
    ok(&io.cmd(s, &data)[0]);
    assert_eq!(read_at(&mut io, 2, 3, 4096, 4096), data);
    // A 512-byte transfer for one block does not match NLB.
    let mut s = sqe(spec::NVM_READ, 3, 1, &[(10, 3), (12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(
        status_of(&io.cmd(s, &[])[0]),
        Status::DATA_SGL_LENGTH_INVALID.field()
    );
    // The last block is in range, the next one is not.
    assert_eq!(
        read_at(&mut io, 4, blocks as u32 - 1, 4096, 4096).len(),
        4096
    );
    let mut s = sqe(spec::NVM_READ, 5, 1, &[(10, blocks as u32), (12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    assert_eq!(
        status_of(&io.cmd(s, &[])[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
    // 128 KiB (MDTS) is 32 blocks; 33 is too many.
    let mut s = sqe(spec::NVM_READ, 6, 1, &[(12, 32)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 33 * 4096);
    assert_ne!(status_of(&io.cmd(s, &[])[0]), 0);
    // Dataset Management counts 4 KiB blocks too.
    let mut s = sqe(
        spec::NVM_DATASET_MANAGEMENT,
        7,
        1,
        &[(11, spec::DSM_ATTR_DEALLOCATE)],
    );
    set_sgl(&mut s, spec::SGL_IN_CAPSULE, 16);
    ok(&io.cmd(s, &dsm_ranges(&[(3, 1)]))[0]);
    assert!(read_at(&mut io, 8, 3, 4096, 4096).iter().all(|&b| b == 0));
}

#[test]
fn c2h_success_only_when_the_host_disabled_sq_flow_control() {
    let shared = shared();
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut plain = io_queue(&shared, cntlid, NQN);
    let mut noflow = Host::new(&shared);
    noflow.ic(DG);
    ok(&noflow.connect_cattr(2, cntlid, NQN, "nqn.host", spec::CATTR_DISABLE_SQ_FLOW));
    write_at(&mut plain, 1, 0, &[9u8; 4096]);

    let read = |h: &mut Host| {
        let mut s = sqe(spec::NVM_READ, 7, 1, &[(12, 7)]);
        set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
        h.cmd(s, &[])
    };
    // SQ flow control on: LAST_PDU only, then a CapsuleResp.
    let got = read(&mut plain);
    assert!(
        matches!(&got[..], [Got::Data { flags, .. }, Got::Resp { status: 0, .. }] if *flags == pdu::FLAG_LAST_PDU),
        "{got:?}"
    );
    // Off: the data PDU carries SUCCESS and is the completion.
    let got = read(&mut noflow);
    assert!(
        matches!(&got[..], [Got::Data { flags, data, cid: 7, .. }] if *flags == pdu::FLAG_LAST_PDU | pdu::FLAG_SUCCESS && data.iter().all(|&b| b == 9)),
        "{got:?}"
    );
    // A failed read still gets a CapsuleResp with its status.
    let mut s = sqe(spec::NVM_READ, 8, 1, &[(10, u32::MAX), (12, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 512);
    assert_eq!(
        status_of(&noflow.cmd(s, &[])[0]),
        Status::LBA_OUT_OF_RANGE.field()
    );
}

#[test]
fn an_io_queue_before_enable_or_unknown_pdus_fail_cleanly() {
    let shared = shared();
    let mut a = Host::new(&shared);
    a.ic(Digests::default());
    let Got::Resp { dw0, status: 0, .. } = a.connect(0, 0xFFFF, NQN) else {
        panic!()
    };
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    assert_eq!(
        status_of(&h.connect(1, dw0 as u16, NQN)),
        Status::COMMAND_SEQUENCE_ERROR.field()
    );
    // A PDU type no host sends: C2HTermReq, then close.
    let got = h.send_raw(&[0x42, 0, 24, 0, 24, 0, 0, 0]);
    assert_eq!(
        got,
        vec![Got::Term {
            fes: pdu::FES_INVALID_HEADER_FIELD,
            fei: 0
        }]
    );
    assert!(h.conn.wire.is_closing());
    // A command before ICReq: a sequence error.
    let mut h = Host::new(&shared);
    let got = h.send(&Pdu::CapsuleCmd {
        sqe: [0; 64],
        data: &[],
    });
    assert_eq!(
        got,
        vec![Got::Term {
            fes: pdu::FES_PDU_SEQUENCE_ERROR,
            fei: 0
        }]
    );
    // A header digest that does not match.
    let mut h = Host::new(&shared);
    h.ic(DG);
    let mut bytes = pdu::encode(
        &Pdu::CapsuleCmd {
            sqe: [0; 64],
            data: &[],
        },
        DG,
    );
    bytes[72] ^= 1;
    let got = h.send_raw(&bytes);
    assert_eq!(
        got,
        vec![Got::Term {
            fes: pdu::FES_HEADER_DIGEST_ERROR,
            fei: 0
        }]
    );
}

#[test]
fn the_discovery_controller_lists_the_volumes() {
    let shared = shared();
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    ok(&h.connect(0, 0xFFFF, spec::DISCOVERY_NQN));
    let mut s = sqe(spec::ADMIN_IDENTIFY, 2, 0, &[(10, 1)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    assert!(matches!(&got[0], Got::Data { data, .. } if data[111] == 2));
    // The header, then the one volume's record.
    let numdl = (2048u32 / 4 - 1) << 16;
    let mut s = sqe(spec::ADMIN_GET_LOG_PAGE, 3, 0, &[(10, numdl | 0x70)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 2048);
    let got = h.cmd(s, &[]);
    let Got::Data { data, .. } = &got[0] else {
        panic!("{got:?}")
    };
    assert_eq!(u64::from_le_bytes(data[8..16].try_into().unwrap()), 1);
    assert_eq!(&data[1024 + 256..1024 + 256 + NQN.len()], NQN.as_bytes());
    // No namespaces, and no I/O queue may join it.
    let mut s = sqe(spec::ADMIN_IDENTIFY, 4, 1, &[(10, 0)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    assert_eq!(
        status_of(&h.cmd(s, &[])[0]),
        Status::INVALID_NAMESPACE.field()
    );
    let mut io = Host::new(&shared);
    io.ic(Digests::default());
    assert_eq!(
        status_of(&io.connect(1, 1, spec::DISCOVERY_NQN)),
        Status::CONNECT_INVALID_PARAMETERS.field()
    );
    // A volume's controller has no discovery log.
    let mut a = Host::new(&shared);
    admin(&mut a);
    let mut s = sqe(spec::ADMIN_GET_LOG_PAGE, 5, 0, &[(10, numdl | 0x70)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 2048);
    assert_eq!(status_of(&a.cmd(s, &[])[0]), Status::INVALID_FIELD.field());
}

/// A command that arrives whole is read with one `read`: the short read
/// says the socket is empty, so the run does not read again just to get
/// EAGAIN (SPDK's target makes one `readv` per command at QD1). Bytes
/// that arrive later are read in the next run (the reactor reports the
/// socket again). A read that fills the room offered is followed by
/// another in the same run (`lull_net`'s `InBuf` tests).
#[test]
fn a_drained_socket_is_not_read_again_in_the_same_run() {
    let shared = shared();
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let mut h = io_queue(&shared, cntlid, NQN);
    write_at(&mut h, 1, 8, &[0x5A; 4096]);

    let reads = h.conn.wire.stream.plain().reads;
    let mut s = sqe(spec::NVM_READ, 2, 1, &[(10, 8), (12, 7)]);
    set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
    let got = h.cmd(s, &[]);
    assert!(matches!(&got[0], Got::Data { cid: 2, data, .. } if data == &[0x5A; 4096]));
    ok(&got[1]);
    assert_eq!(
        h.conn.wire.stream.plain().reads - reads,
        1,
        "one read per command"
    );

    // Half a command, then the rest in a later run.
    let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe: s, data: &[] }, h.dg);
    let (first, rest) = bytes.split_at(30);
    assert!(h.send_raw(first).is_empty());
    let got = h.send_raw(rest);
    assert_eq!(got.len(), 2, "{got:?}");
    ok(&got[1]);

    // A short read that leaves bytes behind (a socket that had only part
    // of them): the rest waits for the next run, as the socket, watched
    // level-triggered, is reported again.
    h.conn.wire.stream.plain_mut().read_max = bytes.len() + 10;
    let reads = h.conn.wire.stream.plain().reads;
    let got = h.send_raw(&[&bytes[..], &bytes[..]].concat());
    assert_eq!(got.len(), 2, "the first command only: {got:?}");
    assert_eq!(h.conn.wire.stream.plain().reads - reads, 1);
    h.run();
    let got = h.take();
    assert_eq!(got.len(), 2, "then the second: {got:?}");
    ok(&got[1]);
}

/// What an idle queue pair costs beyond its poller entry and socket:
/// the connection struct (its input buffer is given back when idle, its
/// slot table grows only with commands in flight).
#[test]
fn an_idle_queue_pair_is_small() {
    let bytes = std::mem::size_of::<Conn<std::net::TcpStream>>();
    eprintln!("Conn<TcpStream>: {bytes} bytes");
    assert!(bytes < 1024, "{bytes} bytes");
    let shared = shared();
    let mut h = Host::new(&shared);
    h.ic(Digests::default());
    ok(&h.connect(0, 0xFFFF, NQN));
    h.conn.wire.inb.release();
    assert!(
        !h.conn.wire.inb.is_held(),
        "an idle queue pair holds no input buffer"
    );
}

proptest! {
    /// Garbage, before or after the IC exchange, never panics: the
    /// target waits for more bytes, or answers with a C2HTermReq and
    /// closes (or answers the commands it could parse).
    #[test]
    fn garbage_ends_in_a_term_req_or_waits(
        bytes in prop::collection::vec(any::<u8>(), 0..2000),
        after_ic in any::<bool>(),
        connect in any::<bool>(),
    ) {
        let shared = shared();
        let mut h = Host::new(&shared);
        if after_ic {
            h.ic(Digests::default());
            if connect {
                ok(&h.connect(0, 0xFFFF, NQN));
            }
        }
        h.conn.wire.stream.plain_mut().input.extend_from_slice(&bytes);
        h.run();
        if h.conn.wire.stream.tls().is_some() {
            // Garbage that opened with a TLS record's first byte: a
            // handshake that waits for more bytes or failed (and closed).
            prop_assert!(!after_ic && bytes[0] == crate::stream::TLS_RECORD_HANDSHAKE);
            prop_assert!(h.conn.tls_handshaking() || h.conn.wire.is_broken());
            return Ok(());
        }
        let out = &h.conn.wire.stream.plain().out[h.seen..];
        if h.conn.wire.is_closing() && !h.conn.wire.is_broken() {
            // The last thing written is a TermReq.
            let pos = out.iter().rposition(|&b| b == pdu::TYPE_C2H_TERM_REQ);
            prop_assert!(pos.is_some(), "closed without a TermReq");
        }
    }
}

/// A memory device whose channel, once a queue pair allowed splicing,
/// hands each successful read over in a pipe holding `short_by` bytes
/// fewer than asked (a device bug the queue pair must not pass on as a
/// short C2HData PDU), and records that splicing was allowed. With
/// `file`, it hands over a range of that file instead (as a file volume
/// on tmpfs does), `short_by` bytes short likewise.
struct PipeDev {
    inner: MallocDev,
    short_by: usize,
    allowed: Arc<std::sync::atomic::AtomicUsize>,
    file: Option<Arc<std::fs::File>>,
}

struct PipeChannel {
    inner: Box<dyn Channel>,
    splice: bool,
    short_by: usize,
    allowed: Arc<std::sync::atomic::AtomicUsize>,
    reads: Vec<(u64, usize)>,
    file: Option<Arc<std::fs::File>>,
}

impl lull_bdev::BlockDevice for PipeDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn describe(&self) -> String {
        "pipe test device".into()
    }
    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(PipeChannel {
            inner: self.inner.open_channel()?,
            splice: false,
            short_by: self.short_by,
            allowed: self.allowed.clone(),
            reads: Vec::new(),
            file: self.file.clone(),
        }))
    }
}

impl Channel for PipeChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if req.op == IoOp::Read {
            self.reads.push((req.tag, req.len as usize));
        }
        self.inner.submit(req)
    }
    fn flush_submissions(&mut self) {
        self.inner.flush_submissions();
    }
    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        let (splice, short_by) = (self.splice, self.short_by);
        let reads = &mut self.reads;
        let file = &self.file;
        self.inner.reap(&mut |mut c| {
            let read = reads.iter().position(|&(tag, _)| tag == c.tag);
            if let (true, Some(i), true) = (splice, read, c.result.is_ok()) {
                let (_, len) = reads.swap_remove(i);
                if let Some(file) = file {
                    c.data =
                        lull_bdev::Data::Spliced(lull_bdev::Spliced::File(lull_bdev::FileRange {
                            file: file.clone(),
                            offset: 0,
                            len: len - short_by,
                        }));
                    return done(c);
                }
                let mut pipe = lull_uring::pipes::get().expect("a pipe");
                let (mut a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
                let n = len - short_by;
                a.write_all(&vec![7u8; n]).expect("fill the socket");
                let fd = std::os::fd::AsRawFd::as_raw_fd(&b);
                assert_eq!(pipe.fill_from(fd, n).expect("splice into the pipe"), n);
                c.data = lull_bdev::Data::Spliced(lull_bdev::Spliced::Pipe(pipe));
            }
            done(c)
        })
    }
    fn event_fd(&self) -> Option<RawFd> {
        self.inner.event_fd()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn allow_splice(&mut self) {
        self.splice = true;
        self.allowed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The lean path's conditions (issue 33): a queue pair allows the device
/// to hand reads over in a pipe only without a data digest (a header
/// digest is fine: lull writes the header), and a pipe of the wrong
/// length fails its command with an error status (no short C2HData PDU,
/// no SUCCESS flag) while the queue pair goes on; nothing counts as
/// spliced.
#[test]
fn a_spliced_read_needs_no_data_digest_and_the_right_length() {
    spliced_read_conditions(None);
}

/// The same for a file range (a file volume on tmpfs): a range of the
/// wrong length is not sent either; nothing counts as sent by sendfile.
#[test]
fn a_file_range_read_needs_no_data_digest_and_the_right_length() {
    let path = std::env::temp_dir().join(format!("lull-nvmf-range-{}", std::process::id()));
    std::fs::write(&path, vec![9u8; 64 << 10]).expect("write the file");
    let file = Arc::new(std::fs::File::open(&path).expect("open the file"));
    std::fs::remove_file(&path).expect("remove the file");
    spliced_read_conditions(Some(file));
}

fn spliced_read_conditions(file: Option<Arc<std::fs::File>>) {
    let files = file.is_some();
    let allowed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let dev = PipeDev {
        inner: MallocDev::new(VOLUME_BYTES).expect("malloc"),
        short_by: 512,
        allowed: allowed.clone(),
        file,
    };
    let volumes = Arc::new(Volumes::default());
    volumes
        .add(Volume::new("v", Storage::Local(Arc::new(dev))))
        .expect("add");
    let conns = Arc::new(Connections::new(Limits {
        name: "nvmf-test",
        max_connections: 8,
        greeting_timeout_us: 1_000_000,
    }));
    let shared = Shared::new(
        volumes.clone(),
        conns,
        std::collections::HashMap::new(),
        "127.0.0.1:4420".parse().unwrap(),
    );
    let mut a = Host::new(&shared);
    let cntlid = admin(&mut a);
    let allowed_now = || allowed.load(std::sync::atomic::Ordering::Relaxed);

    // Both digests: no splicing, reads buffered and right.
    let mut dg = io_queue(&shared, cntlid, NQN);
    assert_eq!(allowed_now(), 0);
    assert!(!dg.conn.wire.splices());
    write_at(&mut dg, 1, 0, &[3u8; 4096]);
    assert!(read_at(&mut dg, 2, 0, 4096, 512).iter().all(|&b| b == 3));

    // A header digest only, and no digest: splicing allowed.
    let mut hdgst = Host::new(&shared);
    hdgst.ic(Digests {
        header: true,
        data: false,
    });
    ok(&hdgst.connect(2, cntlid, NQN));
    assert_eq!(allowed_now(), 1);
    assert!(hdgst.conn.wire.splices());
    let mut plain = Host::new(&shared);
    plain.ic(Digests::default());
    ok(&plain.connect_cattr(3, cntlid, NQN, "nqn.host", spec::CATTR_DISABLE_SQ_FLOW));
    assert_eq!(allowed_now(), 2);

    // The device's pipe is 512 bytes short: an error status for the
    // command, no data PDU, on either kind of queue; the queue goes on.
    for h in [&mut hdgst, &mut plain] {
        let mut s = sqe(spec::NVM_READ, 9, 1, &[(12, 7)]);
        set_sgl(&mut s, spec::SGL_TRANSPORT, 4096);
        let got = h.cmd(s, &[]);
        assert!(
            matches!(&got[..], [Got::Resp { cid: 9, status, .. }] if *status == Status::INTERNAL_ERROR.field()),
            "{got:?}"
        );
        assert!(!h.conn.wire.is_closing());
        write_at(h, 10, 8, &[5u8; 4096]);
    }
    let v = volumes.get("v").expect("the volume");
    assert_eq!(v.stats.snapshot().spliced_reads, 0);
    assert_eq!(v.stats.snapshot().sendfile_reads, 0);
    if !files {
        // (The file case makes no pipe; it may run beside this one.)
        assert_eq!(lull_uring::pipes::live(), 0, "the short pipes went back");
    }
}
