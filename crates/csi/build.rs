//! Compiles the vendored CSI v1 proto (proto/csi.proto) and the kubelet's
//! plugin-registration API (proto/pluginregistration.proto) into the gRPC
//! servers and message types with tonic-prost-build. protox parses the
//! protos in Rust, so building needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/csi.proto", "proto/pluginregistration.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        // The plugin is a server; the client side is only for the tests.
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
