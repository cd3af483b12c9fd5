//! Decodes arbitrary bytes as an NVMe/TCP PDU stream, as the target does.
//!
//! Input layout: one byte whose low two bits say which digests were
//! negotiated (bit 0 header, bit 1 data), then the PDU bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use lull_nvmf::pdu::{self, Digests};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, mut bytes)) = data.split_first() else {
        return;
    };
    let dg = Digests {
        header: flags & 1 != 0,
        data: flags & 2 != 0,
    };
    // A stream of PDUs, as the connection parses them.
    loop {
        match pdu::decode(bytes, dg) {
            Ok(Some((p, used))) => {
                assert!(used >= pdu::CH_LEN && used <= bytes.len());
                // Encoding what was decoded gives a PDU that decodes the
                // same (the encoder writes no padding, so bytes may differ).
                let again = pdu::encode(&p, dg);
                let (q, n) = pdu::decode(&again, dg)
                    .expect("an encoded PDU decodes")
                    .expect("whole");
                assert_eq!(n, again.len());
                assert_eq!(p, q);
                bytes = &bytes[used..];
            }
            Ok(None) => break,
            Err(e) => {
                // The answer to it is a well-formed C2HTermReq.
                let term = pdu::c2h_term_req(&e, bytes);
                let decoded = pdu::decode(&term, Digests::default());
                assert!(matches!(decoded, Ok(Some((pdu::Pdu::TermReq { from_host: false, .. }, _)))));
                break;
            }
        }
    }
});
