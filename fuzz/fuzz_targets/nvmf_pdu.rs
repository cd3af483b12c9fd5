//! Decodes bytes as an NVMe/TCP PDU stream, as the target does (see
//! lull_fuzzcheck::nvmf_pdu for the input layout and the checks).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::nvmf_pdu(data));
