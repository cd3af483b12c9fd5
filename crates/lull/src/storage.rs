//! The `Storage` factory: what stands under a volume of a given
//! backend, opened for `lull serve`'s volumes (`--volume`, the config
//! file, the node's record) and for those created over RPC
//! (`control`'s `volume_create` and `volume_clone`). A memory or file
//! volume is a chain of layers that takes snapshots, `replicas=` an
//! engine over its replicas, `faulty=` a plain device with faults
//! injected.

use std::sync::Arc;

use lull_bdev::{BlockDevice, FileDev, FileOptions, MallocDev};
use lull_net::link::LinkAuth;
use lull_net::tls::{Role, TlsContext};
use lull_volume::Storage;

use lull_config as config;
use lull_config::Backend;

/// How this server's engines reach their replicas, loaded once at start.
#[derive(Debug, Clone)]
pub(crate) enum ReplicaLinks {
    /// No choice was made (no replicated volume at start): replicated
    /// volumes are refused, also over RPC.
    NotConfigured,
    Plain,
    Tls(TlsContext),
}

impl ReplicaLinks {
    /// Load the credentials (an error is the operator's: exit 2), and
    /// warn about plain links.
    pub(crate) fn load(auth: Option<&LinkAuth>) -> Result<ReplicaLinks, String> {
        let Some(auth) = auth else {
            return Ok(ReplicaLinks::NotConfigured);
        };
        match auth.context(Role::Client) {
            Ok(Some(ctx)) => {
                tracing::info!(creds = ?ctx.creds(), "replica links: TLS, replicas must authenticate");
                Ok(ReplicaLinks::Tls(ctx))
            }
            Ok(None) => {
                tracing::warn!("{}", lull_net::link::INSECURE_WARNING);
                Ok(ReplicaLinks::Plain)
            }
            Err(e) => Err(format!("replica links: {e}")),
        }
    }
}

/// The storage of volume `spec`: its engine started on the next reactor
/// (with the node's rebuild budget, and `resume`'s recorded session) for
/// `replicas=`, else a device in this process.
pub(crate) fn open_device(
    spec: &config::VolumeSpec,
    fw: &lull_reactor::FrameworkHandle,
    engine: &lull_engine::EngineOptions,
    links: &ReplicaLinks,
    node_rebuild: &lull_engine::NodeRebuildLimit,
    resume: Option<u64>,
) -> Result<Storage, String> {
    let dev: Arc<dyn BlockDevice> = match &spec.backend {
        Backend::Replicas { addrs } => {
            let tls = match links {
                ReplicaLinks::NotConfigured => {
                    return Err(format!(
                        "a replicated volume, and this server was started without a replica-link choice: {}",
                        LinkAuth::missing(LinkAuth::SERVE_FLAGS)
                    ))
                }
                ReplicaLinks::Plain => None,
                ReplicaLinks::Tls(ctx) => Some(ctx.clone()),
            };
            // Engines are spread over the reactors at start (round robin);
            // the dynamic scheduler moves them later as their load asks.
            let reactor = fw.next_reactor();
            return lull_engine::ReplicatedDev::start_with(
                fw,
                reactor,
                &spec.name,
                addrs.clone(),
                spec.size_bytes,
                engine.clone(),
                tls,
                resume,
            )
            .and_then(|dev| {
                dev.set_node_rebuild_limit(node_rebuild.clone())?;
                Ok(dev)
            })
            .map(Storage::Replicated)
            .map_err(|e| e.to_string());
        }
        Backend::Malloc | Backend::File { .. } => {
            return open_chain(&spec.backend, spec.size_bytes).map(Storage::Layered)
        }
        local => open_local(&spec.name, local, spec.size_bytes)?,
    };
    Ok(Storage::Local(dev))
}

/// A memory or file volume as a chain of layers, so it can take
/// snapshots (`lull_bdev::chain`): a file volume finds its snapshots
/// again in `PATH.lull/`.
pub(crate) fn open_chain(
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<lull_bdev::ChainDev>, String> {
    let store = chain_store(backend, size_bytes)?;
    let describe = store.describe();
    lull_bdev::ChainDev::open(store, size_bytes)
        .map(Arc::new)
        .map_err(|e| format!("{describe}: {e}"))
}

/// Where a chain of `backend` keeps its layers: memory, or files next to
/// the volume's file. Also a clone's head (`volume_clone`).
pub(crate) fn chain_store(
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<dyn lull_bdev::chain::LayerStore>, String> {
    Ok(match backend {
        Backend::Malloc => Arc::new(lull_bdev::chain::MemoryStore::new(Arc::new(
            MallocDev::new(size_bytes).map_err(|e| e.to_string())?,
        ))),
        Backend::File { path, direct, ring } => Arc::new(lull_bdev::chain::FileStore::new(
            path,
            FileOptions {
                direct: *direct,
                create: true,
                ring: *ring,
            },
        )),
        _ => return Err("only memory and file volumes take snapshots".into()),
    })
}

/// A device in this process: memory, a file, or either with faults injected.
fn open_local(
    volume: &str,
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<dyn BlockDevice>, String> {
    Ok(match backend {
        Backend::Malloc => Arc::new(MallocDev::new(size_bytes).map_err(|e| e.to_string())?),
        Backend::File { path, direct, ring } => Arc::new(
            FileDev::open(
                path,
                size_bytes,
                FileOptions {
                    direct: *direct,
                    create: true,
                    ring: *ring,
                },
            )
            .map_err(|e| format!("{}: {e}", path.display()))?,
        ),
        Backend::Faulty {
            inner,
            faults,
            seed,
        } => {
            // No seed given: one from the clock, logged so the run can be repeated.
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            let faults = lull_bdev::Faults { seed, ..*faults };
            let dev = lull_bdev::FaultyDev::new(open_local(volume, inner, size_bytes)?, faults);
            tracing::warn!(
                volume,
                seed,
                read_err = faults.read_err.get(),
                write_err = faults.write_err.get(),
                flush_err = faults.flush_err.get(),
                delay_us = faults.delay_us,
                "FAULT INJECTION ENABLED on this volume: {}",
                dev.describe()
            );
            Arc::new(dev)
        }
        Backend::Replicas { .. } => return Err("a replicated volume is not a local device".into()),
    })
}
