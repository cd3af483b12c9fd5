//! Compiles the vendored CSI v1 proto (proto/csi.proto) into the gRPC
//! server and message types with tonic-prost-build. protox parses the
//! proto in Rust, so building needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/csi.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        // The plugin is a server; the client side is only for the tests.
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
