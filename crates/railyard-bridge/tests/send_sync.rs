//! Public types can cross threads (a node hands them to tasks on any worker).

use railyard_bridge::{
    BridgeConfig, BridgeError, BridgeMetricsSnapshot, BridgeServer, ConfigError, FrameError,
    PermittedOptions, RunningBridge,
};

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn public_types_are_send_and_sync() {
    assert_send_sync::<BridgeServer>();
    assert_send_sync::<RunningBridge>();
    assert_send_sync::<BridgeConfig>();
    assert_send_sync::<PermittedOptions>();
    assert_send_sync::<BridgeMetricsSnapshot>();
    assert_send_sync::<BridgeError>();
    assert_send_sync::<ConfigError>();
    assert_send_sync::<FrameError>();
}

#[test]
fn config_defaults_are_documented_values() {
    let c = BridgeConfig::default();
    assert!(c.enabled);
    assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 7000));
    assert!(c.inbound_permitted.is_empty() && c.outbound_permitted.is_empty());
    assert_eq!(c.max_frame_size, 1 << 20);
    assert_eq!(c.max_headers, 1024);
    assert_eq!(c.outbound_queue_bytes, 1 << 20);
    assert!(c.auth_token.is_none());
    let zero = BridgeConfig {
        max_registrations: 0,
        ..BridgeConfig::default()
    };
    let err = BridgeServer::new(railyard_bus::EventBus::new(), zero).unwrap_err();
    assert_eq!(
        err,
        ConfigError::Zero {
            field: "max_registrations"
        }
    );
}
