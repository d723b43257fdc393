//! Generates client and server code for both contracts with `protoc`
//! (Debian's `protobuf-compiler`, installed by `scripts/setup`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(
            &["proto/GrpcTxEvent.proto", "proto/railyard_saga.proto"],
            &["proto"],
        )?;
    Ok(())
}
