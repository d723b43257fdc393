//! Generates client and server code for both contracts with `protoc`
//! (Debian's `protobuf-compiler`, installed by `scripts/setup`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        // A compensation command's payload (up to 16 MiB) as `Bytes`: the
        // coordinator hands the payload it keeps to the command by reference
        // count instead of copying it (under a shard lock). Events keep
        // `Vec<u8>`: decoded into `Bytes` they would share the received
        // buffer (a live saga would keep it alive), and copying them out
        // instead was 3-5 % slower on the native path in three alternating
        // pairs (within this machine's noise, but never faster).
        .bytes(".GrpcCompensateCommand.payloads")
        .bytes(".railyard.saga.v1.Compensate.payloads")
        .build_client(true)
        .build_server(true)
        .compile_protos(
            &["proto/GrpcTxEvent.proto", "proto/railyard_saga.proto"],
            &["proto"],
        )?;
    Ok(())
}
