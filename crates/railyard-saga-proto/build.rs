//! Generates client and server code for both contracts with `protoc`
//! (Debian's `protobuf-compiler`, installed by `scripts/setup`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        // `bytes` fields (payloads, up to 16 MiB) as `Bytes`: a decoded
        // payload shares the received buffer, and the coordinator hands a
        // compensation's payload to its command by reference count instead
        // of copying it (under a shard lock).
        .bytes(".")
        .build_client(true)
        .build_server(true)
        .compile_protos(
            &["proto/GrpcTxEvent.proto", "proto/railyard_saga.proto"],
            &["proto"],
        )?;
    Ok(())
}
