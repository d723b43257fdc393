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
    assert_eq!(c.frame_timeout, std::time::Duration::from_secs(30));
    assert!(c.idle_timeout.is_none());
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

#[test]
fn timeouts_are_milliseconds_in_files_and_idle_timeout_is_off_unless_given() {
    let c: BridgeConfig = toml::from_str("frame_timeout = 250\nidle_timeout = 60000\n").unwrap();
    assert_eq!(c.frame_timeout, std::time::Duration::from_millis(250));
    assert_eq!(c.idle_timeout, Some(std::time::Duration::from_secs(60)));
    let c: BridgeConfig = toml::from_str("port = 7001\n").unwrap();
    assert_eq!(c.idle_timeout, None);
    assert_eq!(
        toml::from_str::<BridgeConfig>(&toml::to_string(&c).unwrap()).unwrap(),
        c
    );

    for (text, field) in [
        ("frame_timeout = 0", "frame_timeout"),
        ("idle_timeout = 0", "idle_timeout"),
    ] {
        let config: BridgeConfig = toml::from_str(text).unwrap();
        let err = BridgeServer::new(railyard_bus::EventBus::new(), config).unwrap_err();
        assert_eq!(err, ConfigError::ZeroTimeout { field });
    }
    assert_eq!(
        ConfigError::ZeroTimeout {
            field: "idle_timeout"
        }
        .to_string(),
        "[bridge] idle_timeout must be at least 1 (milliseconds); leave idle_timeout out for no idle timeout"
    );
}
