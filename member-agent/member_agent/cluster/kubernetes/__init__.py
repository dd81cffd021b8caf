"""The Kubernetes backend (`backend.KubernetesBackend`) and what it is made of: reading nodes,
pods and quotas (`objects`, `quotas`, `health`, `mig`), the cluster's state (`state`), list and
watch (`watching`), writes retried within a deadline (`writing`, `retrying`, `errors`), DRA
devices and ResourceClaims (`devices`, `claims`, `claiming`, `claimed`), Events on nodes
(`events`). The only importer of kubernetes_asyncio; importing this package imports none of
it, so the agent loads the client only when it runs against a cluster."""
