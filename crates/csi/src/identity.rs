//! The Identity service: the plugin's name and version, what it offers,
//! and whether it is ready.

use tonic::{Request, Response, Status};

use crate::pb::identity_server::Identity;
use crate::pb::plugin_capability::service::Type as ServiceType;
use crate::pb::*;

/// The driver name Kubernetes knows the plugin by (the CSIDriver object,
/// the StorageClass `provisioner`): a reverse domain name, as the spec
/// asks.
pub const DRIVER_NAME: &str = "csi.lull.io";

#[derive(Debug)]
pub struct IdentityPlugin {
    /// Whether this process serves the Controller service.
    pub controller: bool,
}

#[tonic::async_trait]
impl Identity for IdentityPlugin {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let mut services = vec![ServiceType::VolumeAccessibilityConstraints];
        if self.controller {
            services.push(ServiceType::ControllerService);
        }
        let mut capabilities: Vec<PluginCapability> = services
            .into_iter()
            .map(|t| PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service { r#type: t as i32 },
                )),
            })
            .collect();
        // ONLINE: the engine grows a volume in use (ControllerExpandVolume
        // on a staged volume); what the node's attach can then show is
        // NodeExpandVolume's to say (docs/KUBERNETES.md, "Expansion").
        capabilities.push(PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: plugin_capability::volume_expansion::Type::Online as i32,
                },
            )),
        });
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        // Serving is being ready: the node list and TLS material were
        // loaded at start, and a node down is an error of the call that
        // needs it, not of the plugin.
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
