// Command render prints a Helm chart's manifests the way `helm template` does, with the engine
// Helm itself uses: Go's text/template and the sprig function library, plus Helm's own functions
// (include, tpl, required, fail, toYaml, fromYaml, toJson, fromJson, lookup) and its built-in
// objects (.Values, .Release, .Chart, .Capabilities, .Template, .Files).
//
// No Helm binary can be installed where gpufed's tests run, but Debian packages Go and sprig;
// tests/integration/test_helm_render.py builds this program and renders both charts with it.
// It builds offline in GOPATH mode against the Debian packages:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode CGO_ENABLED=0 go build -o render ./deploy/render
//	./render --name gpufed --namespace gpufed-system -f deploy/helm/broker/ci/example-values.yaml deploy/helm/broker
//
// What it does as Helm 3 does: values.yaml coalesced with the -f files in order (maps merge, a
// null deletes a default); every number in .Values is a float64 (so `{{ .Values.n }}` prints a
// large integer as 1.5e+06, as Helm does: pipe it through `int64`); templates parsed in Helm's
// order, partials (`_*`) and NOTES.txt not emitted, `<no value>` blanked; the output split into
// documents, ordered by kind as Helm installs them, each under a `# Source:` line; the chart's
// kubeVersion checked against --kube-version.
//
// What it does not do (see deploy/README.md): subcharts and global values, values.schema.json
// (the tests validate values with jsonschema), --set parsing (write an override file), toToml,
// a real lookup (always empty, as in `helm template`), .Files.Glob/AsConfig/AsSecrets, crds/.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// stringList is a repeatable flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func main() {
	var valueFiles, apiVersions stringList
	name := flag.String("name", "release-name", "release name (.Release.Name)")
	namespace := flag.String("namespace", "default", "release namespace (.Release.Namespace)")
	kubeVersion := flag.String("kube-version", "v1.29.0", "Kubernetes version (.Capabilities.KubeVersion)")
	notes := flag.Bool("notes", false, "print the rendered NOTES.txt instead of the manifests")
	flag.Var(&valueFiles, "f", "values file merged over values.yaml (repeatable, later wins)")
	flag.Var(&valueFiles, "values", "same as -f")
	flag.Var(&apiVersions, "api-versions", "extra API version for .Capabilities.APIVersions (repeatable)")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: render [flags] CHART_DIR\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	out, err := run(flag.Arg(0), options{
		releaseName: *name,
		namespace:   *namespace,
		kubeVersion: *kubeVersion,
		apiVersions: apiVersions,
		valueFiles:  valueFiles,
		notes:       *notes,
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %s\n", err)
		os.Exit(1)
	}
	fmt.Print(out)
}

type options struct {
	releaseName string
	namespace   string
	kubeVersion string
	apiVersions []string
	valueFiles  []string
	notes       bool
}

func run(chartDir string, opts options) (string, error) {
	c, err := loadChart(chartDir)
	if err != nil {
		return "", err
	}
	caps, err := newCapabilities(opts.kubeVersion, opts.apiVersions)
	if err != nil {
		return "", err
	}
	if err := checkKubeVersion(c.Metadata.KubeVersion, caps.KubeVersion.Version); err != nil {
		return "", err
	}
	userValues := map[string]interface{}{}
	for _, file := range opts.valueFiles {
		data, err := os.ReadFile(file)
		if err != nil {
			return "", err
		}
		vals, err := readValues(data)
		if err != nil {
			return "", fmt.Errorf("failed to parse %s: %w", file, err)
		}
		userValues = mergeMaps(userValues, vals)
	}
	top := map[string]interface{}{
		"Chart":        c.Metadata,
		"Capabilities": caps,
		"Release": map[string]interface{}{
			"Name":      opts.releaseName,
			"Namespace": opts.namespace,
			"IsUpgrade": false,
			"IsInstall": true,
			"Revision":  1,
			"Service":   "Helm",
		},
		"Files":  c.Files,
		"Values": coalesce(userValues, c.Values),
	}
	rendered, err := renderTemplates(c, top)
	if err != nil {
		return "", err
	}
	notesName := c.Metadata.Name + "/templates/NOTES.txt"
	if opts.notes {
		return rendered[notesName], nil
	}
	for file := range rendered {
		if strings.HasSuffix(file, "NOTES.txt") {
			delete(rendered, file)
		}
	}
	return formatManifests(rendered)
}
