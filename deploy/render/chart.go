package main

// Loading a chart directory as Helm 3 does: Chart.yaml into the same metadata fields templates
// see as .Chart, values.yaml read the way Helm reads values (YAML through JSON, so numbers are
// float64), every file under templates/ a template, the other files .Files.

import (
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/Masterminds/semver"
	"gopkg.in/yaml.v2"
)

// Metadata has the fields (and so the names, .Chart.AppVersion and so on) of Helm's chart.Metadata.
type Metadata struct {
	Name         string            `yaml:"name"`
	Home         string            `yaml:"home"`
	Sources      []string          `yaml:"sources"`
	Version      string            `yaml:"version"`
	Description  string            `yaml:"description"`
	Keywords     []string          `yaml:"keywords"`
	Maintainers  []Maintainer      `yaml:"maintainers"`
	Icon         string            `yaml:"icon"`
	APIVersion   string            `yaml:"apiVersion"`
	Condition    string            `yaml:"condition"`
	Tags         string            `yaml:"tags"`
	AppVersion   string            `yaml:"appVersion"`
	Deprecated   bool              `yaml:"deprecated"`
	Annotations  map[string]string `yaml:"annotations"`
	KubeVersion  string            `yaml:"kubeVersion"`
	Dependencies []interface{}     `yaml:"dependencies"`
	Type         string            `yaml:"type"`
}

type Maintainer struct {
	Name  string `yaml:"name"`
	Email string `yaml:"email"`
	URL   string `yaml:"url"`
}

type chart struct {
	Metadata  *Metadata
	Values    map[string]interface{}
	Templates map[string]string // "<chart name>/templates/<path>" -> text
	Files     Files
}

func loadChart(dir string) (*chart, error) {
	raw, err := os.ReadFile(filepath.Join(dir, "Chart.yaml"))
	if err != nil {
		return nil, err
	}
	meta := &Metadata{}
	if err := yaml.UnmarshalStrict(raw, meta); err != nil {
		return nil, fmt.Errorf("Chart.yaml: %w", err)
	}
	if meta.APIVersion != "v2" || meta.Name == "" || meta.Version == "" {
		return nil, fmt.Errorf("Chart.yaml: needs apiVersion v2, a name and a version")
	}
	if len(meta.Dependencies) > 0 {
		return nil, fmt.Errorf("Chart.yaml: dependencies (subcharts) are not supported by this renderer")
	}
	c := &chart{Metadata: meta, Values: map[string]interface{}{}, Templates: map[string]string{}, Files: Files{}}
	if data, err := os.ReadFile(filepath.Join(dir, "values.yaml")); err == nil {
		if c.Values, err = readValues(data); err != nil {
			return nil, fmt.Errorf("values.yaml: %w", err)
		}
	} else if !os.IsNotExist(err) {
		return nil, err
	}
	err = filepath.Walk(dir, func(file string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, file)
		rel = filepath.ToSlash(rel)
		if info.IsDir() {
			if rel == "charts" || rel == "crds" || strings.HasPrefix(info.Name(), ".") && rel != "." {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasPrefix(info.Name(), ".") {
			return nil // .helmignore and the like
		}
		data, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			c.Templates[path.Join(meta.Name, rel)] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml" || rel == "values.schema.json" || rel == "Chart.lock":
		default:
			c.Files[rel] = data
		}
		return nil
	})
	return c, err
}

// readValues reads YAML as Helm does (sigs.k8s.io/yaml): through JSON, so maps have string keys
// and every number is a float64.
func readValues(data []byte) (map[string]interface{}, error) {
	var doc interface{}
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	if doc == nil {
		return map[string]interface{}{}, nil
	}
	j, err := json.Marshal(jsonCompatible(doc))
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := json.Unmarshal(j, &out); err != nil {
		return nil, fmt.Errorf("the top level must be a map: %w", err)
	}
	return out, nil
}

func jsonCompatible(v interface{}) interface{} {
	switch v := v.(type) {
	case map[interface{}]interface{}:
		m := make(map[string]interface{}, len(v))
		for key, value := range v {
			m[fmt.Sprint(key)] = jsonCompatible(value)
		}
		return m
	case []interface{}:
		l := make([]interface{}, len(v))
		for i, value := range v {
			l[i] = jsonCompatible(value)
		}
		return l
	default:
		return v
	}
}

// mergeMaps merges -f files: later files win, maps merge recursively.
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if vm, ok := v.(map[string]interface{}); ok {
			if am, ok := out[k].(map[string]interface{}); ok {
				out[k] = mergeMaps(am, vm)
				continue
			}
		}
		out[k] = v
	}
	return out
}

// coalesce lays the user's values over the chart's defaults: maps merge, anything else replaces,
// and a null deletes the default.
func coalesce(user, defaults map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(defaults))
	for k, v := range defaults {
		out[k] = v
	}
	for k, v := range user {
		if v == nil {
			delete(out, k)
			continue
		}
		um, uok := v.(map[string]interface{})
		dm, dok := out[k].(map[string]interface{})
		if uok && dok {
			out[k] = coalesce(um, dm)
		} else {
			out[k] = v
		}
	}
	return out
}

// Capabilities mirrors Helm's .Capabilities.
type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion HelmVersion
}

type KubeVersion struct {
	Version string // v1.29.0
	Major   string
	Minor   string
}

func (k KubeVersion) String() string     { return k.Version }
func (k KubeVersion) GitVersion() string { return k.Version }

type HelmVersion struct {
	Version      string
	GitCommit    string
	GitTreeState string
	GoVersion    string
}

// VersionSet is .Capabilities.APIVersions: `.Capabilities.APIVersions.Has "policy/v1"`.
type VersionSet []string

func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

// builtinAPIVersions are the group versions a Kubernetes 1.27+ API server serves (Helm derives its
// default set from client-go's scheme; CRDs' groups come with --api-versions, as with Helm).
var builtinAPIVersions = []string{
	"v1", "admissionregistration.k8s.io/v1", "apiextensions.k8s.io/v1", "apiregistration.k8s.io/v1",
	"apps/v1", "authentication.k8s.io/v1", "authorization.k8s.io/v1", "autoscaling/v1",
	"autoscaling/v2", "batch/v1", "certificates.k8s.io/v1", "coordination.k8s.io/v1",
	"discovery.k8s.io/v1", "events.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1beta3",
	"networking.k8s.io/v1", "node.k8s.io/v1", "policy/v1", "rbac.authorization.k8s.io/v1",
	"scheduling.k8s.io/v1", "storage.k8s.io/v1",
}

func newCapabilities(kubeVersion string, extra []string) (*Capabilities, error) {
	v, err := semver.NewVersion(kubeVersion)
	if err != nil {
		return nil, fmt.Errorf("invalid kube version %q: %w", kubeVersion, err)
	}
	apis := append(VersionSet{}, builtinAPIVersions...)
	apis = append(apis, extra...)
	sort.Strings(apis)
	return &Capabilities{
		KubeVersion: KubeVersion{
			Version: "v" + v.String(),
			Major:   fmt.Sprint(v.Major()),
			Minor:   fmt.Sprint(v.Minor()),
		},
		APIVersions: apis,
		HelmVersion: HelmVersion{Version: "v3.21.4", GoVersion: "go1.19 (deploy/render)"},
	}, nil
}

func checkKubeVersion(constraint, version string) error {
	if constraint == "" {
		return nil
	}
	c, err := semver.NewConstraint(constraint)
	if err != nil {
		return fmt.Errorf("Chart.yaml kubeVersion %q: %w", constraint, err)
	}
	v, err := semver.NewVersion(version)
	if err != nil {
		return err
	}
	if !c.Check(v) {
		return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes %s", constraint, version)
	}
	return nil
}

// Files is .Files: the chart's files outside templates/ (Get, GetBytes, Lines; no Glob).
type Files map[string][]byte

func (f Files) GetBytes(name string) []byte { return f[name] }
func (f Files) Get(name string) string      { return string(f[name]) }
func (f Files) Lines(name string) []string {
	if f[name] == nil {
		return []string{}
	}
	return strings.Split(strings.TrimRight(string(f[name]), "\n"), "\n")
}
