package main

// From rendered files to `helm template`'s output: each file split into YAML documents, the
// documents ordered by kind in Helm's install order (files by path, documents in file order
// within a kind), hooks after the rest, each printed after "---" and a "# Source:" line.

import (
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"

	"gopkg.in/yaml.v2"
)

// installOrder is Helm 3's releaseutil.InstallOrder.
var installOrder = []string{
	"PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
	"PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
	"ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
	"CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
	"ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service",
	"DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
	"HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
	"APIService",
}

// Helm 3's document separator: a line starting with "---", with the whitespace around it.
var separator = regexp.MustCompile(`(?:^|\s*\n)---\s*`)

type manifest struct {
	source  string
	content string
	kind    string
}

type head struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
}

func formatManifests(rendered map[string]string) (string, error) {
	files := make([]string, 0, len(rendered))
	for name := range rendered {
		files = append(files, name)
	}
	sort.Strings(files)
	var generic, hooks []manifest
	for _, file := range files {
		content := rendered[file]
		if strings.HasPrefix(path.Base(file), "_") || strings.TrimSpace(content) == "" {
			continue
		}
		for _, doc := range separator.Split(strings.TrimSpace(content), -1) {
			if doc == "" {
				continue
			}
			doc = strings.TrimSpace(doc)
			var h head
			if err := yaml.Unmarshal([]byte(doc), &h); err != nil {
				return "", fmt.Errorf("YAML parse error on %s: %w", file, err)
			}
			m := manifest{source: file, content: doc, kind: h.Kind}
			if _, isHook := h.Metadata.Annotations["helm.sh/hook"]; isHook {
				hooks = append(hooks, m)
			} else {
				generic = append(generic, m)
			}
		}
	}
	sortByKind(generic)
	sortByKind(hooks)
	var b strings.Builder
	for _, m := range generic {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", m.source, m.content)
	}
	out := strings.TrimSpace(b.String()) + "\n"
	for _, m := range hooks {
		out += fmt.Sprintf("---\n# Source: %s\n%s\n", m.source, m.content)
	}
	return out, nil
}

// sortByKind orders stably by install order; unknown kinds go last, by kind name.
func sortByKind(ms []manifest) {
	rank := make(map[string]int, len(installOrder))
	for i, kind := range installOrder {
		rank[kind] = i
	}
	sort.SliceStable(ms, func(i, j int) bool {
		ri, iKnown := rank[ms[i].kind]
		rj, jKnown := rank[ms[j].kind]
		switch {
		case !iKnown && !jKnown:
			return ms[i].kind < ms[j].kind
		case !iKnown:
			return false
		case !jKnown:
			return true
		}
		return ri < rj
	})
}
