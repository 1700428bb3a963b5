// Go through sluice: http.ProxyFromEnvironment (skips localhost / 127.0.0.1) and a
// fixed http.ProxyURL (does not). Run: go run client.go
package main

import (
	"fmt"
	"net/http"
	"net/url"
	"os"
)

func get(label string, proxy func(*http.Request) (*url.URL, error), target string) {
	client := &http.Client{Transport: &http.Transport{Proxy: proxy}}
	req, _ := http.NewRequest("GET", target, nil)
	req.Header.Set("X-Endpoint-Id", "demo")
	res, err := client.Do(req)
	if err != nil {
		fmt.Printf("%s: error %v\n", label, err)
		return
	}
	res.Body.Close()
	fmt.Printf("%s: %d %s\n", label, res.StatusCode, res.Header.Get("X-Sluice-Reason"))
}

func main() {
	proxy := os.Getenv("PROXY")
	if proxy == "" {
		proxy = "http://127.0.0.1:8080"
	}
	target := os.Getenv("TARGET")
	if target == "" {
		target = "http://127.0.0.1:9000/hello"
	}
	os.Setenv("HTTP_PROXY", proxy)
	get("go ProxyFromEnvironment (loopback target)", http.ProxyFromEnvironment, target)
	u, _ := url.Parse(proxy)
	get("go ProxyURL", http.ProxyURL(u), target)
	u.User = url.UserPassword("demo", "x")
	get("go ProxyURL demo:x@", http.ProxyURL(u), target)
}
