module lull/cluster/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 v3.6.16

replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 v3.6.16
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 v3.6.16
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 v3.6.16
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 v3.6.16
)
