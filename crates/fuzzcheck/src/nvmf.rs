//! The NVMe/TCP target's PDU decoder.

use lull_nvmf::pdu::{self, Digests};

/// Decodes bytes as an NVMe/TCP PDU stream, as the target does. Input: one
/// byte whose low two bits say which digests were negotiated (bit 0
/// header, bit 1 data), then the PDU bytes. What decodes re-encodes to a
/// PDU that decodes the same (the encoder writes no padding, so bytes may
/// differ); every refusal's answer is a well-formed C2HTermReq.
pub fn nvmf_pdu(data: &[u8]) {
    let Some((&flags, mut bytes)) = data.split_first() else {
        return;
    };
    let dg = Digests {
        header: flags & 1 != 0,
        data: flags & 2 != 0,
    };
    loop {
        match pdu::decode(bytes, dg) {
            Ok(Some((p, used))) => {
                assert!(used >= pdu::CH_LEN && used <= bytes.len());
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
                let term = pdu::c2h_term_req(&e, bytes);
                let decoded = pdu::decode(&term, Digests::default());
                assert!(matches!(
                    decoded,
                    Ok(Some((
                        pdu::Pdu::TermReq {
                            from_host: false,
                            ..
                        },
                        _
                    )))
                ));
                break;
            }
        }
    }
}
