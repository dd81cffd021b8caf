package main

// The template engine as Helm 3 sets it up: one text/template set holding every file of
// templates/ (so any file may `include` a `define` from any other), missingkey=zero, sprig's
// functions without env and expandenv, and Helm's own functions bound to that set.

import (
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v2"
)

// Messages of `required` and `fail` travel inside text/template's error between these markers,
// so that the error printed is the chart's message with its file and line, as Helm prints it.
const (
	messageStart   = "RENDER_MSG_START"
	messageEnd     = "RENDER_MSG_END"
	maxIncludeNest = 1000
)

var messagePattern = regexp.MustCompile(messageStart + `((?s).*)` + messageEnd)

func chartMessage(msg string) error { return errors.New(messageStart + msg + messageEnd) }

func renderTemplates(c *chart, top map[string]interface{}) (rendered map[string]string, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("rendering template failed: %v", r)
		}
	}()
	t := template.New("gotpl").Option("missingkey=zero")
	t.Funcs(helmFuncs(t, map[string]int{}))

	names := parseOrder(c.Templates)
	for _, name := range names {
		if _, err := t.New(name).Parse(c.Templates[name]); err != nil {
			return nil, parseError(name, err)
		}
	}
	rendered = map[string]string{}
	for _, name := range names {
		if strings.HasPrefix(path.Base(name), "_") {
			continue // partials hold `define`s; they are never emitted
		}
		top["Template"] = map[string]interface{}{"Name": name, "BasePath": path.Join(c.Metadata.Name, "templates")}
		var buf strings.Builder
		if err := t.ExecuteTemplate(&buf, name, top); err != nil {
			return nil, execError(name, err)
		}
		// missingkey=zero still prints "<no value>" for a missing key of an interface map.
		rendered[name] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return rendered, nil
}

// parseOrder is Helm's: deeper paths first, then by name descending. A `define` parsed later
// wins, so this decides which of two same-named defines a chart gets.
func parseOrder(templates map[string]string) []string {
	names := make([]string, 0, len(templates))
	for name := range templates {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool {
		di, dj := strings.Count(names[i], "/"), strings.Count(names[j], "/")
		if di != dj {
			return di > dj
		}
		return names[i] > names[j]
	})
	return names
}

func helmFuncs(t *template.Template, included map[string]int) template.FuncMap {
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env")
	delete(funcs, "expandenv")
	helm := template.FuncMap{
		"include":       includeFunc(t, included),
		"tpl":           tplFunc(t, included),
		"required":      required,
		"fail":          func(msg string) (string, error) { return "", chartMessage(msg) },
		"toYaml":        toYAML,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"toToml":        unsupported("toToml"),
		"fromToml":      unsupported("fromToml"),
		// `helm template` has no cluster to look in: lookup finds nothing.
		"lookup": func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
			return map[string]interface{}{}, nil
		},
		// Helm resolves no DNS names unless --enable-dns.
		"getHostByName": func(string) string { return "" },
	}
	for name, fn := range helm {
		funcs[name] = fn
	}
	return funcs
}

func includeFunc(t *template.Template, included map[string]int) func(string, interface{}) (string, error) {
	return func(name string, data interface{}) (string, error) {
		if included[name] > maxIncludeNest {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		included[name]++
		defer func() { included[name]-- }()
		var buf strings.Builder
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
}

// tplFunc renders a string as a template, in a copy of the chart's template set so that the
// string can include the chart's defines (and define its own, for itself only).
func tplFunc(parent *template.Template, included map[string]int) func(string, interface{}) (string, error) {
	return func(text string, data interface{}) (string, error) {
		t, err := parent.Clone()
		if err != nil {
			return "", fmt.Errorf("cannot clone template: %w", err)
		}
		t.Option("missingkey=zero")
		t.Funcs(template.FuncMap{"include": includeFunc(t, included), "tpl": tplFunc(t, included)})
		t, err = t.New(parent.Name()).Parse(text)
		if err != nil {
			return "", fmt.Errorf("cannot parse template %q: %w", text, err)
		}
		var buf strings.Builder
		if err := t.Execute(&buf, data); err != nil {
			return "", fmt.Errorf("error during tpl function execution for %q: %w", text, err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
}

func required(msg string, value interface{}) (interface{}, error) {
	if s, isString := value.(string); value == nil || isString && s == "" {
		return value, chartMessage(msg)
	}
	return value, nil
}

func unsupported(name string) func(interface{}) (string, error) {
	return func(interface{}) (string, error) {
		return "", chartMessage(name + " is not supported by deploy/render (no TOML library in Debian's Go packages)")
	}
}

// toYAML is Helm's (sigs.k8s.io/yaml): JSON first, so keys are sorted, struct fields take their
// JSON names and numbers print as integers where they are whole; no trailing newline.
func toYAML(v interface{}) string {
	out, err := marshalYAML(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(out, "\n")
}

func marshalYAML(v interface{}) (string, error) {
	j, err := json.Marshal(v)
	if err != nil {
		return "", err
	}
	var obj interface{}
	if err := yaml.Unmarshal(j, &obj); err != nil {
		return "", err
	}
	y, err := yaml.Marshal(obj)
	return string(y), err
}

func fromYAML(text string) map[string]interface{} {
	m, err := readValues([]byte(text))
	if err != nil {
		return map[string]interface{}{"Error": err.Error()}
	}
	return m
}

func fromYAMLArray(text string) []interface{} {
	var doc interface{}
	if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
		return []interface{}{err.Error()}
	}
	j, err := json.Marshal(jsonCompatible(doc))
	if err != nil {
		return []interface{}{err.Error()}
	}
	out := []interface{}{}
	if err := json.Unmarshal(j, &out); err != nil {
		return []interface{}{err.Error()}
	}
	return out
}

func toJSON(v interface{}) string {
	j, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(j)
}

func fromJSON(text string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(text), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJSONArray(text string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(text), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

// parseError and execError shorten text/template's errors to Helm's shape:
// "execution error at (broker/templates/deployment.yaml:42:20): tokens.existingSecret is required".
func parseError(name string, err error) error {
	parts := strings.Split(err.Error(), ": ")
	if len(parts) < 2 {
		return fmt.Errorf("parse error in (%s): %s", name, err)
	}
	return fmt.Errorf("parse error at (%s): %s", parts[1], parts[len(parts)-1])
}

func execError(name string, err error) error {
	var exec template.ExecError
	if !errors.As(err, &exec) {
		return err
	}
	parts := strings.SplitN(err.Error(), ": ", 3)
	if len(parts) != 3 {
		return fmt.Errorf("execution error in (%s): %s", name, err)
	}
	if m := messagePattern.FindStringSubmatch(parts[2]); m != nil {
		return fmt.Errorf("execution error at (%s): %s", parts[1], m[1])
	}
	return err
}
